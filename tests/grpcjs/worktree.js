// Cline's worktree panel against uibus, as grpc-js sees it: cline.WorktreeService loaded from
// upstream's own worktree.proto (protos/cline/worktree.proto, unmodified) with @grpc/proto-loader,
// as Cline's webview stack does. Runs a list of calls in order and prints what each got.
// Usage: node worktree.js TARGET SESSION CALLS_JSON
//   CALLS_JSON: [{"rpc": "listWorktrees", "request": {...}, "agent": "coder", "host": true}, ...]
//   `agent` sets the metadata key x-uibus-agent; `host` subscribes to HostService.SubscribeHostRequests
//   first (as an editor host would) and records the first host request the call caused.
// Prints one JSON array: {"reply": ...} or {"code": "NOT_FOUND", "details": "..."} per call (and "host").
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, session, callsJson] = process.argv.slice(2, 5);
const protos = path.resolve(__dirname, "..", "..", "protos");
const defs = loader.loadSync(["cline/worktree.proto", "uibus/v1/host.proto"], {
  includeDirs: [protos], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const pkg = grpc.loadPackageDefinition(defs);
const creds = grpc.credentials.createInsecure();
const worktrees = new pkg.cline.WorktreeService(target, creds);
const host = new pkg.uibus.v1.HostService(target, creds);
const md = (agent) => {
  const m = new grpc.Metadata();
  m.set("x-uibus-session", session);
  if (agent) m.set("x-uibus-agent", agent);
  return m;
};
const unary = (client, method, request, agent) => new Promise((resolve, reject) => {
  client[method](request, md(agent), (err, reply) => (err ? reject(err) : resolve(reply)));
});
const outcome = (promise) => promise.then((reply) => ({ reply }),
                                          (err) => ({ code: grpc.status[err.code], details: err.details }));

// The call made once the host's stream is subscribed (its headers mean so), with the first host request.
function withHost(act) {
  return new Promise((resolve, reject) => {
    const call = host.SubscribeHostRequests({}, md());
    const timer = setTimeout(() => { call.cancel(); reject(new Error("no host request came")); }, 10000);
    call.on("error", (err) => { if (err.code !== grpc.status.CANCELLED) reject(err); });
    call.on("metadata", () => {
      outcome(act()).then((got) => {
        if (got.code) { clearTimeout(timer); call.cancel(); resolve(got); return; }
        call.on("data", (msg) => { clearTimeout(timer); call.cancel(); resolve({ ...got, host: msg }); });
      });
    });
  });
}

(async () => {
  const out = [];
  for (const { rpc, request, agent, host: hosted } of JSON.parse(callsJson)) {
    if (typeof worktrees[rpc] !== "function") throw new Error(`no rpc ${rpc} in worktree.proto`);
    const act = () => unary(worktrees, rpc, request || {}, agent);
    out.push(hosted ? await withHost(act) : await outcome(act()));
  }
  process.stdout.write(JSON.stringify(out));
  worktrees.close();
  host.close();
})().catch((err) => {
  process.stdout.write(JSON.stringify({ error: String(err && err.stack || err) }));
  process.exitCode = 1;
});
