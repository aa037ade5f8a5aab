// The third bench server: bench/raw_server.py's twin on @grpc/grpc-js (what Cline's standalone core
// serves cline.UiService with), so the bench can set uibus against the stack Cline itself runs.
// Same paths, same messages (loaded from the repo's protos/ with proto-loader), same behaviour:
//   cline.UiService/scrollToSettings          -> KeyValuePair{key: "scrollToSettings", value: request.value}
//   cline.UiService/subscribeToPartialMessage -> one bounded drop-oldest queue of 256 per subscriber
//   uibus.v1.HostService/PublishPartialMessage -> the message on every queue; PublishReply{subscribers}
//   uibus.v1.HostService/GetBusStats          -> the counters raw reports (kind "partial_message")
//   <canonical>.AgentService/StreamingChat    -> --chat-chunks small AI ChatResponses + a final one,
//                                                each echoing the request
// Nothing else: no session, no validation, no store, no interceptors.
// Usage: node bench/grpcjs/server.js --port P [--chat-chunks 1000]; SIGTERM/SIGINT stop it (exit 0).
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const QUEUE_SIZE = 256; // uibus's default --queue-size, as raw
const KIND = "partial_message";

function parseArgs(argv) {
  const opts = { port: 0, chatChunks: 1000 };
  for (let i = 0; i < argv.length; i++) {
    const [flag, inline] = argv[i].split("=", 2);
    const value = inline !== undefined ? inline : argv[++i];
    if (flag === "--port") opts.port = Number(value);
    else if (flag === "--chat-chunks") opts.chatChunks = Number(value);
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!opts.port) throw new Error("--port P is required");
  return opts;
}

const opts = parseArgs(process.argv.slice(2));
const protos = path.resolve(__dirname, "..", "..", "protos");
// keepCase/longs as tests/grpcjs/live.js. `defaults` stays off on purpose: an echoed message
// (the published ClineMessage, the chat request) is re-encoded as decoded, and protobufjs writes
// every field set on the object, so decoded defaults would put all empty fields on the wire, which
// raw (protobuf's proto3 encoder) never sends. Without them the bytes match raw's.
const defs = loader.loadSync(["cline/ui.proto", "uibus/v1/host.proto", "neuro_san/api/grpc/agent.proto"], {
  includeDirs: [protos], keepCase: true, longs: Number, defaults: false,
});
const pkg = grpc.loadPackageDefinition(defs);

// Subscribers of the one topic the bench uses, plus the counters GetBusStats reports.
const subs = new Set();
const stats = { published: 0, delivered: 0, dropped: 0 };

// Moves queued messages into the call while grpc-js takes them (write() true); after a false the
// subscriber waits for 'drain', so a slow reader fills its own queue and loses its oldest events.
function pump(sub) {
  while (!sub.waiting && sub.queue.length) {
    if (!sub.call.write(sub.queue.shift())) sub.waiting = true;
  }
}

function publish(msg) {
  stats.published += 1;
  for (const sub of subs) {
    if (sub.queue.length >= QUEUE_SIZE) {
      sub.queue.shift();
      stats.dropped += 1;
    }
    sub.queue.push(msg);
    if (!sub.waiting) pump(sub);
  }
  stats.delivered += subs.size;
  return subs.size;
}

// Resolves on 'drain', or on 'cancelled' (a cancelled call never drains).
function drained(call) {
  return new Promise((resolve) => {
    const done = () => {
      call.off("drain", done);
      call.off("cancelled", done);
      resolve();
    };
    call.once("drain", done);
    call.once("cancelled", done);
  });
}

function nonzero(obj) {
  for (const key of Object.keys(obj)) if (obj[key] === 0) delete obj[key];
  return obj;
}

const ui = {
  scrollToSettings(call, callback) {
    callback(null, { key: "scrollToSettings", value: call.request.value });
  },
  subscribeToPartialMessage(call) {
    const sub = { call, queue: [], waiting: false };
    subs.add(sub);
    const close = () => {
      subs.delete(sub);
      sub.queue.length = 0;
    };
    call.on("cancelled", close);
    call.on("error", close);
    call.on("close", close);
    call.on("drain", () => {
      sub.waiting = false;
      pump(sub);
    });
  },
};

const host = {
  PublishPartialMessage(call, callback) {
    callback(null, { subscribers: publish(call.request) });
  },
  GetBusStats(call, callback) {
    const n = subs.size;
    // Zero counters are left out: protobufjs would write a field set to 0, proto3 encoders do not.
    callback(null, nonzero({
      kinds: [nonzero({ kind: KIND, subscriptions: n, published: stats.published, delivered: stats.delivered,
                        dropped: stats.dropped })],
      subscriptions: n,
    }));
  },
};

const agent = {
  async StreamingChat(call) {
    const request = call.request;
    let cancelled = false;
    call.on("cancelled", () => { cancelled = true; });
    for (let i = 0; i < opts.chatChunks; i++) {
      if (cancelled) return;
      if (!call.write({ request, response: { type: "AI", text: `w${i} ` } })) await drained(call);
    }
    if (cancelled) return;
    call.write({ request, response: { type: "AGENT_FRAMEWORK", text: "done" } });
    call.end();
  },
};

const server = new grpc.Server();
server.addService(pkg.cline.UiService.service, ui);
server.addService(pkg.uibus.v1.HostService.service, host);
server.addService(pkg.dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService.service, {
  StreamingChat: (call) => agent.StreamingChat(call).catch((err) => call.destroy(err)),
});
server.bindAsync(`127.0.0.1:${opts.port}`, grpc.ServerCredentials.createInsecure(), (err) => {
  if (err) {
    process.stderr.write(`grpcjs bench server: ${err.message}\n`);
    process.exit(1);
  }
});

// Like raw's server.stop(1): finish in-flight calls, but give up on them after a second.
function stop() {
  const force = setTimeout(() => {
    server.forceShutdown();
    process.exit(0);
  }, 1000);
  server.tryShutdown(() => {
    clearTimeout(force);
    process.exit(0);
  });
}
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
