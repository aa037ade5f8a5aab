// An editor for tests/test_acp_serve.py: the official SDK's client app (@agentclientprotocol/sdk,
// pinned by package-lock.json) attached to uibus as an editor attaches to its agent, either by
// spawning `uibus acp …` (stdio) or over `/acp` (the SDK's WebSocket transport).
//
//   node editor.mjs stdio <command> [args…]          spawn the agent, speak ACP on its stdio
//   node editor.mjs ws <url> [<header-json>]          connect to a remote ACP agent over WebSocket
//   node editor.mjs http <url> [<header-json>]        ... over Streamable HTTP (the SDK's createHttpStream)
//
// The test drives it with JSON lines on stdin and reads what happened as JSON lines on stdout:
//   {"op":"request","tag":T,"method":M,"params":P} -> {"ev":"response","tag":T,"result":R}
//                                                    | {"ev":"error","tag":T,"code":C,"message":S}
//   {"op":"notify","method":M,"params":P}
//   {"op":"withdraw","tag":T}                        $/cancel_request of our request T
//   {"op":"answer","id":K,"result":R}                answers the agent's request K (permission, elicitation)
// and, unasked: {"ev":"update","params":P} (session/update), {"ev":"ask","id":K,"method":M,"params":P}
// (the agent asks), {"ev":"withdrawn","id":K} ($/cancel_request of K), {"ev":"closed"},
// {"ev":"socket_error","message":S} (WebSocket only: e.g. a refused upgrade).
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { createRequire } from "node:module";
import { Readable, Writable } from "node:stream";
import { client, methods, ndJsonStream } from "@agentclientprotocol/sdk";
import { createWebSocketStream } from "@agentclientprotocol/sdk/experimental/ws-client";
import { createHttpStream } from "@agentclientprotocol/sdk/experimental/http-client";

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const [mode, target, ...rest] = process.argv.slice(2);

let stream;
let child;
if (mode === "stdio") {
  child = spawn(target, rest, { stdio: ["pipe", "pipe", "inherit"] });
  child.on("exit", (code, signal) => emit({ ev: "exit", code, signal }));
  stream = ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));
} else if (mode === "http") {
  stream = createHttpStream(target, { headers: rest[0] ? JSON.parse(rest[0]) : {} });
} else {
  // Node 20 has no WebSocket of its own: the `ws` package pi's tests install (tests/pi, pinned).
  const require = createRequire(new URL("../pi/package.json", import.meta.url));
  const { WebSocket } = require("ws");
  class Reporting extends WebSocket { // a refused upgrade is "Unexpected server response: <status>"
    constructor(...args) {
      super(...args);
      this.on("error", (e) => emit({ ev: "socket_error", message: String(e.message) }));
    }
  }
  stream = createWebSocketStream(target, { WebSocket: Reporting, headers: rest[0] ? JSON.parse(rest[0]) : {} });
}

const waiting = new Map(); // our id -> resolve (the test's answer)
let asked = 0;
function ask(method) {
  return async (ctx) => {
    const id = ++asked;
    const answered = new Promise((resolve) => waiting.set(id, resolve));
    const withdrawn = new Promise((resolve) => ctx.signal.addEventListener("abort", () => resolve("withdrawn")));
    emit({ ev: "ask", id, method, params: ctx.params });
    const result = await Promise.race([answered, withdrawn]);
    waiting.delete(id);
    if (result === "withdrawn") {
      emit({ ev: "withdrawn", id });
      throw ctx.signal.reason;
    }
    return result;
  };
}

const app = client({ name: "uibus-test-editor" })
  .onNotification(methods.client.session.update, (ctx) => emit({ ev: "update", params: ctx.params }))
  .onRequest(methods.client.session.requestPermission, ask(methods.client.session.requestPermission))
  .onRequest(methods.client.elicitation.create, ask(methods.client.elicitation.create));
const conn = app.connect(stream);
conn.closed.then(() => emit({ ev: "closed" }), (e) => emit({ ev: "closed", error: String(e) }));

const requests = new Map(); // tag -> AbortController (withdraw sends $/cancel_request)
const input = createInterface({ input: process.stdin });
input.on("line", (line) => {
  const cmd = JSON.parse(line);
  if (cmd.op === "request") {
    const abort = new AbortController();
    requests.set(cmd.tag, abort);
    conn.agent.request(cmd.method, cmd.params, { cancellationSignal: abort.signal }).then(
      (result) => emit({ ev: "response", tag: cmd.tag, result: result ?? null }),
      (e) => emit({ ev: "error", tag: cmd.tag, code: e.code, message: e.message, data: e.data ?? null }));
  } else if (cmd.op === "withdraw") {
    requests.get(cmd.tag)?.abort();
  } else if (cmd.op === "notify") {
    conn.agent.notify(cmd.method, cmd.params);
  } else if (cmd.op === "answer") {
    waiting.get(cmd.id)?.(cmd.result);
  }
});
input.on("close", () => {
  conn.close();
  if (child) child.stdin.end();
});
