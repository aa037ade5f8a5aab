// Today's Cline webview against uibus, as grpc-js sees it: the six UiService RPCs upstream Cline
// added after the seed protos. The host side is driven through HostService like a real host:
// the worktrees and marketplace button streams get the host's clicks, subscribeToShowWebview the
// host's show request, openWalkthrough reaches the host's request stream, setTerminalExecutionMode
// is answered as Cline answers and read back by the host, trackIntent is accepted (the Python side
// reads /metrics and the trace).
// Usage: node today.js TARGET SESSION TRACEPARENT  -> one JSON object with what each step saw.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [target, session, traceparent] = process.argv.slice(2, 5);
const protos = path.resolve(__dirname, "..", "..", "protos");
const defs = loader.loadSync(["cline/ui.proto", "uibus/v1/host.proto"], {
  includeDirs: [protos], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const pkg = grpc.loadPackageDefinition(defs);
const creds = grpc.credentials.createInsecure();
const ui = new pkg.cline.UiService(target, creds);
const host = new pkg.uibus.v1.HostService(target, creds);
const md = () => {
  const m = new grpc.Metadata();
  m.set("x-uibus-session", session);
  if (traceparent) m.set("traceparent", traceparent);
  return m;
};
const unary = (client, method, request) => new Promise((resolve, reject) => {
  client[method](request, md(), (err, reply) => (err ? reject(err) : resolve(reply)));
});

// Opens a server stream, waits for its headers (uibus sends them once the subscription is
// registered), runs `act`, and resolves with the first message and `act`'s result.
function firstAfter(call, act) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("timed out")), 10000);
    call.on("error", (err) => { if (err.code !== grpc.status.CANCELLED) reject(err); });
    call.on("metadata", () => {
      act().then((acted) => {
        call.on("data", (msg) => {
          clearTimeout(timer);
          call.cancel();
          resolve({ msg, acted });
        });
      }, reject);
    });
  });
}

(async () => {
  const out = {};
  for (const [rpc, button] of [["subscribeToWorktreesButtonClicked", "BUTTON_WORKTREES"],
                               ["subscribeToMarketplaceButtonClicked", "BUTTON_MARKETPLACE"]]) {
    const got = await firstAfter(ui[rpc]({}, md()), () => unary(host, "PublishButtonClick", { button }));
    out[rpc] = { subscribers: got.acted.subscribers, msg: got.msg };
  }
  const shown = await firstAfter(ui.subscribeToShowWebview({}, md()),
                                 () => unary(host, "PublishShowWebview", { preserve_editor_focus: true }));
  out.subscribeToShowWebview = { subscribers: shown.acted.subscribers, msg: shown.msg };

  const walk = await firstAfter(host.SubscribeHostRequests({}, md()), () => unary(ui, "openWalkthrough", {}));
  out.openWalkthrough = { reply: walk.acted, request: walk.msg.request };
  for (let i = 0; ; i++) {  // the cancelled host stream gone on the server too
    const stats = await unary(host, "GetBusStats", {});
    const kind = stats.kinds.find((k) => k.kind === "host_request");
    if (!kind || Number(kind.subscriptions) === 0) break;
    if (i > 200) throw new Error("the host stream was never unsubscribed");
    await new Promise((r) => setTimeout(r, 10));
  }
  try {  // nobody listens now: the webview hears so
    await unary(ui, "openWalkthrough", {});
    out.openWalkthroughUnheard = "OK";
  } catch (err) {
    out.openWalkthroughUnheard = grpc.status[err.code];
  }

  const mode = await firstAfter(host.SubscribeHostRequests({}, md()),
                                () => unary(ui, "setTerminalExecutionMode", { value: true }));
  out.setTerminalExecutionMode = { reply: mode.acted, told: mode.msg.terminal_execution_mode };
  out.stateAfterBackground = (await unary(host, "GetSessionState", {})).terminal_execution_mode;
  out.setTerminalExecutionModeOff = await unary(ui, "setTerminalExecutionMode", { value: false });
  out.stateAfterTerminal = (await unary(host, "GetSessionState", {})).terminal_execution_mode;

  out.trackIntent = await unary(ui, "trackIntent", {
    action: "prompt_submitted", source: "chat", has_text: true, has_images: false, has_files: true,
    has_active_task: false, text_length: 42,
  });
  await unary(ui, "trackIntent", { action: "new_task_clicked", source: "toolbar" });
  await unary(ui, "trackIntent", { action: "something-new", source: "x" });
  try {
    await unary(ui, "trackIntent", { action: "a".repeat(300) });
    out.trackIntentTooLong = "OK";
  } catch (err) {
    out.trackIntentTooLong = grpc.status[err.code];
  }
  process.stdout.write(JSON.stringify(out) + "\n");
  ui.close();
  host.close();
})().catch((err) => { process.stdout.write(JSON.stringify({ error: String(err) }) + "\n"); process.exit(1); });
