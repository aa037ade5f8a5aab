// The headers guarantee, as a grpc-js client sees it: open `subscribeToAddToInput`, wait for the
// call's 'metadata' event (uibus sends the response headers once the subscription is registered),
// publish with HostService.PublishAddToInput, and expect `subscribers == 1` and the event itself.
// Usage: node live.js TARGET SESSION ROUNDS  -> one JSON line per round, then {"done": ROUNDS}.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, session, rounds] = [process.argv[2], process.argv[3], Number(process.argv[4] || 100)];
const protos = path.resolve(__dirname, "..", "..", "protos");
const defs = loader.loadSync(["cline/ui.proto", "uibus/v1/host.proto"], {
  includeDirs: [protos], keepCase: true, longs: Number, defaults: true,
});
const pkg = grpc.loadPackageDefinition(defs);
const creds = grpc.credentials.createInsecure();
const ui = new pkg.cline.UiService(target, creds);
const host = new pkg.uibus.v1.HostService(target, creds);
const md = () => { const m = new grpc.Metadata(); m.set("x-uibus-session", session); return m; };

function round(i) {
  return new Promise((resolve, reject) => {
    const call = ui.subscribeToAddToInput({}, md());
    const timer = setTimeout(() => reject(new Error(`round ${i}: timed out`)), 5000);
    call.on("error", (err) => { if (err.code !== grpc.status.CANCELLED) reject(err); });
    call.on("metadata", () => {
      host.PublishAddToInput({ text: `js${i}` }, md(), (err, reply) => {
        if (err) return reject(err);
        call.on("data", (msg) => {
          clearTimeout(timer);
          call.cancel();
          resolve({ round: i, subscribers: reply.subscribers, got: msg.value });
        });
      });
    });
  });
}

(async () => {
  for (let i = 0; i < rounds; i++) {
    process.stdout.write(JSON.stringify(await round(i)) + "\n");
  }
  process.stdout.write(JSON.stringify({ done: rounds }) + "\n");
  ui.close();
  host.close();
})().catch((err) => { process.stdout.write(JSON.stringify({ error: String(err) }) + "\n"); process.exit(1); });
