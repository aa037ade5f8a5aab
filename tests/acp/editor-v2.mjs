// An ACP v2 (draft) editor for tests/test_acp_v2.py: the official SDK's experimental v2 client app
// (@agentclientprotocol/sdk/experimental/v2, pinned by package-lock.json), unmodified, attached to
// uibus as editor.mjs attaches its v1 client: spawning `uibus acp …` (stdio) or over `/acp` (the
// SDK's WebSocket transport). The SDK validates every message it reads against its v2 schema.
//
//   node editor-v2.mjs stdio <command> [args…]
//   node editor-v2.mjs ws <url> [<header-json>]
//
// Driven with JSON lines on stdin, reporting JSON lines on stdout, as editor.mjs:
//   {"op":"request","tag":T,"method":M,"params":P} -> {"ev":"response","tag":T,"result":R}
//                                                    | {"ev":"error","tag":T,"code":C,"message":S}
//   {"op":"notify","method":M,"params":P}
//   {"op":"answer","id":K,"result":R}                answers the agent's request K
// and the SDK's session helpers (ActiveSession):
//   {"op":"start","tag":T,"cwd":D}                   buildSession(D).start() -> response {sessionId}
//   {"op":"prompt","tag":T,"sessionId":S,"text":X}   session.prompt(X) -> response {messageId}
// what each active session's nextUpdate() reads, in order:
//   {"ev":"next","sessionId":S,"kind":"session_update"|"stop","update":U,"stopReason":R,"meta":M}
// and, unasked: {"ev":"update","params":P} (every session/update, validated by the SDK),
// {"ev":"ask","id":K,"method":M,"params":P}, {"ev":"withdrawn","id":K}, {"ev":"closed"},
// {"ev":"invalid","message":S} (a message the SDK refused to take).
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { createRequire } from "node:module";
import { Readable, Writable } from "node:stream";
import { client, methods, ndJsonStream } from "@agentclientprotocol/sdk/experimental/v2";
import { createWebSocketStream } from "@agentclientprotocol/sdk/experimental/ws-client";

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const [mode, target, ...rest] = process.argv.slice(2);

let stream;
let child;
if (mode === "stdio") {
  child = spawn(target, rest, { stdio: ["pipe", "pipe", "inherit"] });
  child.on("exit", (code, signal) => emit({ ev: "exit", code, signal }));
  stream = ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));
} else {
  const require = createRequire(new URL("../pi/package.json", import.meta.url));
  const { WebSocket } = require("ws");
  class Reporting extends WebSocket {
    constructor(...args) {
      super(...args);
      this.on("error", (e) => emit({ ev: "socket_error", message: String(e.message) }));
    }
  }
  stream = createWebSocketStream(target, { WebSocket: Reporting, headers: rest[0] ? JSON.parse(rest[0]) : {} });
}

const waiting = new Map();
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

process.on("unhandledRejection", (e) => emit({ ev: "invalid", message: String(e?.message ?? e) }));
const origError = console.error;
console.error = (...args) => { // the SDK reports a message it could not take here
  emit({ ev: "invalid", message: args.map((a) => String(a?.message ?? a)).join(" ") });
  origError(...args);
};

const app = client({ name: "uibus-test-editor-v2" })
  .onNotification(methods.client.session.update, (ctx) => emit({ ev: "update", params: ctx.params }))
  .onRequest(methods.client.session.requestPermission, ask(methods.client.session.requestPermission))
  .onRequest(methods.client.elicitation.create, ask(methods.client.elicitation.create));
const conn = app.connect(stream);
conn.closed.then(() => emit({ ev: "closed", reason: String(conn.signal.reason ?? "") }),
  (e) => emit({ ev: "closed", error: String(e) }));

const sessions = new Map(); // sessionId -> ActiveSession
async function pump(session) {
  for (;;) {
    let message;
    try {
      message = await session.nextUpdate();
    } catch {
      return; // the connection closed
    }
    emit({ ev: "next", sessionId: session.sessionId, kind: message.kind, update: message.update,
           stopReason: message.stopReason ?? null, meta: message.notification._meta ?? null });
  }
}

const done = (tag) => [
  (result) => emit({ ev: "response", tag, result: result ?? null }),
  (e) => emit({ ev: "error", tag, code: e.code, message: e.message, data: e.data ?? null }),
];

const input = createInterface({ input: process.stdin });
input.on("line", (line) => {
  const cmd = JSON.parse(line);
  if (cmd.op === "request") {
    conn.agent.request(cmd.method, cmd.params).then(...done(cmd.tag));
  } else if (cmd.op === "start") {
    conn.agent.buildSession(cmd.cwd).start().then((session) => {
      sessions.set(session.sessionId, session);
      void pump(session);
      return { sessionId: session.sessionId, response: session.newSessionResponse };
    }).then(...done(cmd.tag));
  } else if (cmd.op === "prompt") {
    sessions.get(cmd.sessionId).prompt(cmd.text).then(...done(cmd.tag));
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
