// The fan-out subscribers on @grpc/grpc-js (`python -m bench --subscribers node`): the bench's
// Python subscriber role (bench/workers.py `subscribe`) in Node. Measured at S=1000 (the JSON's
// `_fanout.S<n>.subscriber_cpu_us`), receiving costs about 100 µs of client CPU per message here
// (Node plus the Python worker relaying its count), against about 135 µs with grpc.aio. So a
// little more of a 2-core machine is left to the server, and the clients are Cline's own stack.
//
// It opens --streams subscribeToPartialMessage streams, --per-channel per channel (100), each channel on
// its own connection as separate clients have. Messages carry "<tag>:<monotonic ns at publish>".
// Node's process.hrtime and Python's time.monotonic_ns read the same clock (CLOCK_MONOTONIC), so
// the latency of every message not tagged "max" is kept per tag.
// stdout, one line each:
//   "c <n>"    the messages received so far, at most once a millisecond
//   "r <json>" {lat_ns: {tag: [ns…]}, errors: [...], n_errors, node_cpu_s} once stopped
// stdin: "stop" (or EOF) cancels every stream and ends the process.
// Usage: node bench/grpcjs/subscriber.js --target HOST:PORT --streams N [--per-channel 100] [--session bench]
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");


function parseArgs(argv) {
  const opts = { target: "", streams: 0, perChannel: 100, session: "bench" }; // 100: as bench/workers.py
  for (let i = 0; i < argv.length; i++) {
    const [flag, inline] = argv[i].split("=", 2);
    const value = inline !== undefined ? inline : argv[++i];
    if (flag === "--target") opts.target = value;
    else if (flag === "--streams") opts.streams = Number(value);
    else if (flag === "--per-channel") opts.perChannel = Number(value);
    else if (flag === "--session") opts.session = value;
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!opts.target || !(opts.streams > 0)) throw new Error("--target HOST:PORT and --streams N are required");
  return opts;
}

const opts = parseArgs(process.argv.slice(2));
const protos = path.resolve(__dirname, "..", "..", "protos");
const defs = loader.loadSync(["cline/ui.proto"], { includeDirs: [protos], keepCase: true, longs: Number });
const UiService = grpc.loadPackageDefinition(defs).cline.UiService;

let received = 0;
let reported = -1;
let flushing = false;
const latNs = {};
const errors = [];
let nErrors = 0;

function flush() {
  flushing = false;
  if (received !== reported) {
    reported = received;
    process.stdout.write(`c ${received}\n`);
  }
}

function onMessage(msg) {
  const now = process.hrtime.bigint();
  received += 1;
  const text = msg.text || "";
  const colon = text.indexOf(":");
  const tag = colon < 0 ? text : text.slice(0, colon);
  if (tag !== "max" && colon >= 0) {
    (latNs[tag] || (latNs[tag] = [])).push(Number(now - BigInt(text.slice(colon + 1))));
  }
  if (!flushing) { // at most one line a millisecond: the Python side that relays it stays cheap
    flushing = true;
    setTimeout(flush, 1);
  }
}

const metadata = new grpc.Metadata();
metadata.set("x-uibus-session", opts.session);
const clients = [];
const calls = [];
for (let i = 0; i < opts.streams; i++) {
  if (i % opts.perChannel === 0) {
    clients.push(new UiService(opts.target, grpc.credentials.createInsecure(), { "grpc.use_local_subchannel_pool": 1 }));
  }
  const call = clients[clients.length - 1].subscribeToPartialMessage({}, metadata);
  call.on("data", onMessage);
  call.on("error", (err) => {
    if (err.code !== grpc.status.CANCELLED) {
      nErrors += 1;
      if (errors.length < 5) errors.push(`${grpc.status[err.code]}: ${err.details}`);
    }
  });
  calls.push(call);
}

let stopped = false;
function stop() {
  if (stopped) return;
  stopped = true;
  for (const call of calls) call.cancel();
  flush();
  const cpu = process.cpuUsage();
  const report = { lat_ns: latNs, errors, n_errors: nErrors, node_cpu_s: (cpu.user + cpu.system) / 1e6 };
  process.stdout.write(`r ${JSON.stringify(report)}\n`, () => {
    for (const client of clients) client.close();
    process.exit(0);
  });
}

let input = "";
process.stdin.on("data", (chunk) => {
  input += chunk;
  if (input.includes("stop")) stop();
});
process.stdin.on("end", stop);
