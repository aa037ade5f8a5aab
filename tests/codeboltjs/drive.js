// Drives the real, unmodified @codebolt/codeboltjs against a running uibus: every function of the
// table (codeboltjs-table.json) is called once, in order, and must settle within SETTLE_MS.
//
// The library connects itself, as it does for a real agent: to ws://localhost:$SOCKET_PORT/codebolt
// with the id from ./codeboltagent.yaml (the test runs this script in a folder holding one).
//
// Output: one JSON line per event on stdout, read by tests/test_codeboltjs.py, which plays the UI
// side (answers waits and dialogs when it reads a "call" line):
//   {"event": "ready"}
//   {"event": "call", "call": "fs.readFile"}
//   {"event": "result", "call": ..., "kind": ..., "settled": true, "ms": 3, "value": {...}, "valid": ...}
//   {"event": "pushed", "value": {...}}          a messageResponse reached onActionMessage
//   {"event": "done"}
// `valid` is what the library's own companion package (@codebolt/types, the zod schemas of every
// app-to-agent reply) says of a served reply: "ok", or the schema's complaint.
"use strict";
const fs = require("fs");
const path = require("path");
const readline = require("readline");
const { kindOf } = require("./kinds");

const SETTLE_MS = 1000;
const here = __dirname;
const table = JSON.parse(fs.readFileSync(path.join(here, "codeboltjs-table.json"), "utf8"));
const codebolt = require(path.join(here, "node_modules/@codebolt/codeboltjs")).default;
process.chdir(here);  // codeboltagent.yaml was read; relative paths of the table (getJsTree) are from here
const schemas = require(path.join(here, "node_modules/@codebolt/types/dist/app-to-agent-ws-schema.js"));

// reply type -> the zod schema @codebolt/types gives for it
const SCHEMA = {};
for (const value of Object.values(schemas)) {
  const literal = value && value.shape && value.shape.type && value.shape.type._def && value.shape.type._def.value;
  if (typeof literal === "string" && !(literal in SCHEMA)) SCHEMA[literal] = value;
}

const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function validate(value) {
  if (!value || typeof value !== "object" || typeof value.type !== "string") return "no reply object";
  const schema = SCHEMA[value.type];
  if (!schema) return `no schema for ${value.type}`;
  const result = schema.safeParse(value);
  return result.success ? "ok" : JSON.stringify(result.error.issues).slice(0, 500);
}

function settle(value, kind, row) {
  return new Promise((resolve) => {
    const timer = setTimeout(() => resolve({ settled: false }), SETTLE_MS);
    const done = (how, v) => { clearTimeout(timer); resolve({ settled: true, how, value: v }); };
    if (kind === "promise") value.then((v) => done("resolved", v), (e) => done("rejected", String(e)));
    else if (kind === "emitter") {
      for (const w of row.waits) value.once(w.value, (v) => done(w.value, v));
    } else { clearTimeout(timer); resolve({ settled: true, how: kind, value: undefined }); }
  });
}

// A settled value as JSON: replies are plain objects; what the library builds itself (syntax trees,
// emitters) is cut down to its top-level plain fields.
function safe(value) {
  try {
    const text = JSON.stringify(value);
    if (text === undefined || text.length < 100000) return value;
  } catch (err) { /* circular */ }
  const out = {};
  for (const [k, v] of Object.entries(value)) if (v === null || typeof v !== "object") out[k] = v;
  return out;
}

async function main() {
  await codebolt.waitForConnection();
  // The agent's main entry: user messages the app pushes (type messageResponse).
  codebolt.chat.onActionMessage().on("userMessage", (req, respond) => {
    out({ event: "pushed", value: req });
    respond(`agent got: ${req.message && req.message.userMessage}`);
  });
  out({ event: "ready" });
  // The test says when to go on after "ready" and after each "pause" row (a line on stdin).
  const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  await lines.next();
  for (const row of table.calls) {
    if (row.kind === "listener") continue;
    // Stubs of the library itself (pdf_to_text): they send nothing and never settle, whatever the app does.
    if (!row.sends.length && row.kind === "promise" && !row.local) continue;
    const [module, name] = row.call.split(".");
    out({ event: "call", call: row.call });
    const t0 = Date.now();
    let value;
    try { value = codebolt[module][name](...(row.args || [])); } catch (err) { value = Promise.reject(err); }
    const kind = kindOf(value);
    const r = await settle(value, kind, row);
    const result = { event: "result", call: row.call, kind, ms: Date.now() - t0, ...r, value: safe(r.value) };
    if (r.settled && r.value && typeof r.value === "object" && r.value.type && SCHEMA[r.value.type] && r.value.success !== false) {
      result.valid = validate(r.value);
    }
    out(result);
    if (row.pause) await lines.next();
  }
  // Let fire-and-forget frames reach the server before the socket closes.
  await sleep(100);
  out({ event: "done" });
  await lines.next();
  codebolt.websocket.close();
  await sleep(50);
  process.exit(0);
}

main().catch((err) => { out({ event: "error", error: String(err && err.stack || err) }); process.exit(1); });
