// A grpc-js client that propagates W3C trace context the way an OpenTelemetry-instrumented one
// does (the `traceparent` metadata key): one unary HostService.PublishAddToInput, then a
// subscribeToAddToInput stream it cancels once the event came.
// Usage: node traced.js TARGET SESSION TRACEPARENT  -> {"subscribers": N, "got": "..."}
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, session, traceparent] = process.argv.slice(2, 5);
const protos = path.resolve(__dirname, "..", "..", "protos");
const defs = loader.loadSync(["cline/ui.proto", "uibus/v1/host.proto"], {
  includeDirs: [protos], keepCase: true, longs: Number, defaults: true,
});
const pkg = grpc.loadPackageDefinition(defs);
const creds = grpc.credentials.createInsecure();
const ui = new pkg.cline.UiService(target, creds);
const host = new pkg.uibus.v1.HostService(target, creds);
const md = () => {
  const m = new grpc.Metadata();
  m.set("x-uibus-session", session);
  m.set("traceparent", traceparent);
  return m;
};

new Promise((resolve, reject) => {
  const call = ui.subscribeToAddToInput({}, md());
  const timer = setTimeout(() => reject(new Error("timed out")), 10000);
  call.on("error", (err) => { if (err.code !== grpc.status.CANCELLED) reject(err); });
  call.on("metadata", () => {
    host.PublishAddToInput({ text: "traced" }, md(), (err, reply) => {
      if (err) return reject(err);
      call.on("data", (msg) => {
        clearTimeout(timer);
        call.cancel();
        resolve({ subscribers: reply.subscribers, got: msg.value });
      });
    });
  });
}).then((out) => {
  process.stdout.write(JSON.stringify(out) + "\n");
  ui.close();
  host.close();
}).catch((err) => { process.stdout.write(JSON.stringify({ error: String(err) }) + "\n"); process.exit(1); });
