// An ACP agent written with the official SDK (@agentclientprotocol/sdk, pinned by package-lock.json)
// for tests/test_acp_agent.py: what a prompt says decides what it does, so one fixture shows every
// side of the protocol uibus must handle as the client.
//
//   "tour"      every session/update kind (thought, plan, tool_call execute + updates with output,
//               a read tool, a message in chunks, a user message chunk, available commands, the
//               current mode, one unknown kind), a session/request_permission
//               whose answer it reports, then end_turn
//   "slow"      one chunk, then waits for session/cancel and ends `cancelled` (writes a line to
//               $ACP_FIXTURE_LOG when the cancel arrives)
//   "mcp"       calls ask_user on the first HTTP MCP server of session/new (with its headers) and
//               says what the user answered
//   "refuse"    one chunk, then ends the turn with stopReason `refusal`
//   "limit"     one chunk, then ends the turn with stopReason `max_tokens`
//   "diff"      an edit tool_call with `diff` content (one line changed in 30) and one creating a file,
//               then a session_info_update title and two available commands
//   "fail"      answers the prompt with a JSON-RPC error
// A prompt's non-text blocks are logged ({attached}); it takes images, not embedded files.
// session/new offers two modes (default, plan); session/set_mode is logged and answered with a
// current_mode_update
//   anything    echoes it, with the turn number of the session (its conversation lives here)
//
// It logs what it was given (initialize, session/new) to $ACP_FIXTURE_LOG as JSON lines.
//
// With $ACP_FIXTURE_ROOTS=1 it advertises sessionCapabilities.additionalDirectories and resume:
// session/new and session/resume keep the session's additionalDirectories (logged), and the prompt
// "roots" says them. With $ACP_FIXTURE_AUTH=terminal it offers only a terminal sign-in method,
// advertises auth.status and auth.logout, says `unauthenticated` to auth/status and refuses
// session/new with auth_required; a `logout` (which uibus must never send) is logged.
//
// With $ACP_FIXTURE_STATE (a directory) it advertises `loadSession` and keeps each session's turns
// there, as a real agent keeps its conversations: `session/load` replays the transcript as
// session/update notifications (user_message_chunk, agent_message_chunk) before it answers, and
// fails for a session it does not have. Without it, `loadSession` is false.
import { appendFileSync, existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Readable, Writable } from "node:stream";
import { agent, methods, ndJsonStream, RequestError } from "@agentclientprotocol/sdk/unstable";

const logFile = process.env.ACP_FIXTURE_LOG;
const note = (obj) => { if (logFile) appendFileSync(logFile, JSON.stringify(obj) + "\n"); };
const sessions = new Map(); // sessionId -> { turns, mcp, cancel, transcript }
const stateDir = process.env.ACP_FIXTURE_STATE;
const roots = process.env.ACP_FIXTURE_ROOTS === "1";
const terminalAuth = process.env.ACP_FIXTURE_AUTH === "terminal";
let next = 0;
const stateFile = (sessionId) => join(stateDir, `${sessionId}.json`);
const save = (sessionId, s) => {
  if (stateDir) writeFileSync(stateFile(sessionId), JSON.stringify({ turns: s.turns, transcript: s.transcript }));
};

async function update(client, sessionId, u) {
  await client.notify(methods.client.session.update, { sessionId, update: u });
}

async function say(client, sessionId, text) {
  for (const word of text.split(/(?<= )/)) {
    await update(client, sessionId, { sessionUpdate: "agent_message_chunk", content: { type: "text", text: word } });
  }
}

async function tour(client, sessionId) {
  await update(client, sessionId, { sessionUpdate: "agent_thought_chunk", content: { type: "text", text: "I should " } });
  await update(client, sessionId, { sessionUpdate: "agent_thought_chunk", content: { type: "text", text: "clean the build." } });
  await update(client, sessionId, { sessionUpdate: "plan", entries: [
    { content: "Look at the build", priority: "high", status: "completed" },
    { content: "Remove the cache", priority: "medium", status: "in_progress" }] });
  await update(client, sessionId, { sessionUpdate: "tool_call", toolCallId: "read-1", title: "Read package.json",
    kind: "read", status: "completed", locations: [{ path: "/work/package.json" }],
    content: [{ type: "content", content: { type: "text", text: "{\"name\": \"demo\"}" } }] });
  await update(client, sessionId, { sessionUpdate: "tool_call", toolCallId: "cmd-1", title: "rm -rf build",
    kind: "execute", status: "pending", rawInput: { command: "rm -rf build" } });
  const answer = await client.request(methods.client.session.requestPermission, {
    sessionId, toolCall: { toolCallId: "cmd-1", title: "rm -rf build", kind: "execute", status: "pending" },
    options: [{ optionId: "allow-always", name: "Always Allow", kind: "allow_always" },
              { optionId: "allow", name: "Allow", kind: "allow_once" },
              { optionId: "reject", name: "Reject", kind: "reject_once" }] });
  const chosen = answer.outcome.outcome === "selected" ? answer.outcome.optionId : "cancelled";
  if (chosen.startsWith("allow")) {
    await update(client, sessionId, { sessionUpdate: "tool_call_update", toolCallId: "cmd-1", status: "in_progress",
      content: [{ type: "content", content: { type: "text", text: "removing build\n" } }] });
    await update(client, sessionId, { sessionUpdate: "tool_call_update", toolCallId: "cmd-1", status: "completed",
      content: [{ type: "content", content: { type: "text", text: "removing build\nremoved\n" } }] });
  } else {
    await update(client, sessionId, { sessionUpdate: "tool_call_update", toolCallId: "cmd-1", status: "failed",
      content: [{ type: "content", content: { type: "text", text: "The user rejected this." } }] });
  }
  // The kinds a client may show or not (uibus does not): never logged as unknown.
  await update(client, sessionId, { sessionUpdate: "user_message_chunk", content: { type: "text", text: "tour" } });
  await update(client, sessionId, { sessionUpdate: "available_commands_update", availableCommands: [
    { name: "review", description: "Review the changes" }] });
  await update(client, sessionId, { sessionUpdate: "current_mode_update", currentModeId: "default" });
  await update(client, sessionId, { sessionUpdate: "mystery_update", whatever: 1 });
  await say(client, sessionId, `Permission: ${chosen}.`);
}

async function askUser(server) {
  const headers = { "content-type": "application/json", accept: "application/json, text/event-stream" };
  for (const h of server.headers) headers[h.name] = h.value;
  const post = async (body, extra = {}) => {
    const res = await fetch(server.url, { method: "POST", headers: { ...headers, ...extra }, body: JSON.stringify(body) });
    const type = res.headers.get("content-type") || "";
    const text = await res.text();
    const json = type.includes("event-stream")
      ? JSON.parse(text.split("\n").filter((l) => l.startsWith("data:")).pop().slice(5)) : JSON.parse(text);
    return { res, json };
  };
  const init = await post({ jsonrpc: "2.0", id: 1, method: "initialize", params: {
    protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "fixture", version: "1" } } });
  const sid = init.res.headers.get("mcp-session-id");
  const more = sid ? { "mcp-session-id": sid, "mcp-protocol-version": "2025-06-18" } : {};
  await post({ jsonrpc: "2.0", method: "notifications/initialized" }, more).catch(() => undefined);
  const call = await post({ jsonrpc: "2.0", id: 2, method: "tools/call", params: {
    name: "ask_user", arguments: { title: "Which branch?", kind: "select", options: ["main", "dev"] } } }, more);
  return JSON.stringify(call.json.result?.structuredContent ?? call.json.result ?? call.json.error);
}

const app = agent({ name: "uibus-acp-fixture" })
  .onRequest(methods.agent.initialize, ({ params }) => {
    note({ initialize: params });
    return { protocolVersion: 1, agentCapabilities: { loadSession: Boolean(stateDir), mcpCapabilities: { http: true, sse: false },
      promptCapabilities: { image: true, audio: false, embeddedContext: false },
      ...(roots ? { sessionCapabilities: { additionalDirectories: {}, resume: {} } } : {}),
      ...(terminalAuth ? { auth: { status: {}, logout: {} } } : {}) },
      authMethods: terminalAuth ? [{ id: "terminal-login", name: "Log in from the terminal", type: "terminal",
        args: ["--login"], env: { FIXTURE_LOGIN: "1" } }] : [] };
  })
  .onRequest(methods.agent.auth.status, () => {
    note({ "auth/status": true });
    return { state: terminalAuth ? "unauthenticated" : "not_required" };
  })
  .onRequest(methods.agent.logout, () => {
    note({ logout: true });
    return {};
  })
  .onRequest(methods.agent.session.resume, ({ params }) => {
    const s = sessions.get(params.sessionId);
    if (!s) throw RequestError.invalidParams({ sessionId: params.sessionId }, "unknown session");
    s.roots = params.additionalDirectories || [];
    note({ "session/resume": params });
    return {};
  })
  .onRequest(methods.agent.session.new, ({ params }) => {
    if (terminalAuth) throw RequestError.authRequired();
    const sessionId = stateDir ? `fixture-${process.pid}-${++next}` : `fixture-${++next}`;
    sessions.set(sessionId, { turns: 0, mcp: params.mcpServers, cancel: null, transcript: [],
      roots: params.additionalDirectories || [] });
    note({ "session/new": params, sessionId });
    return { sessionId, modes: { currentModeId: "default", availableModes: [
      { id: "default", name: "Default", description: "Ask before edits" },
      { id: "plan", name: "Plan", description: "Plan only, change nothing" }] } };
  })
  .onRequest(methods.agent.session.load, async ({ params, client }) => {
    if (!stateDir || !existsSync(stateFile(params.sessionId))) {
      throw RequestError.invalidParams({ sessionId: params.sessionId }, "Session not found");
    }
    const kept = JSON.parse(readFileSync(stateFile(params.sessionId), "utf8"));
    const s = { turns: kept.turns, transcript: kept.transcript, mcp: params.mcpServers, cancel: null };
    sessions.set(params.sessionId, s);
    for (const [user, reply] of s.transcript) {
      await update(client, params.sessionId, { sessionUpdate: "user_message_chunk", content: { type: "text", text: user } });
      await update(client, params.sessionId, { sessionUpdate: "agent_message_chunk", content: { type: "text", text: reply } });
    }
    note({ "session/load": params, replayed: s.transcript.length });
    return {};
  })
  .onRequest(methods.agent.session.prompt, async ({ params, client }) => {
    const s = sessions.get(params.sessionId);
    if (!s) throw RequestError.invalidParams({ sessionId: params.sessionId }, "unknown session");
    s.turns += 1;
    const text = params.prompt.filter((b) => b.type === "text").map((b) => b.text).join("");
    const attached = params.prompt.filter((b) => b.type !== "text");
    if (attached.length) note({ attached: attached.map((b) => ({ type: b.type, mimeType: b.mimeType, bytes: (b.data || "").length })) });
    if (text === "roots") {
      await say(client, params.sessionId, `Roots: ${JSON.stringify(s.roots || [])}`);
    } else if (text === "tour") {
      await tour(client, params.sessionId);
    } else if (text === "slow") {
      await say(client, params.sessionId, "Working ");
      await new Promise((resolve) => { s.cancel = resolve; });
      note({ cancelled: params.sessionId });
      // $ACP_FIXTURE_CANCEL_MS: how long it takes to wind the cancelled turn down (a real agent
      // finishes its tool call, writes its transcript) before it records it and answers the prompt
      await new Promise((resolve) => setTimeout(resolve, Number(process.env.ACP_FIXTURE_CANCEL_MS || 0)));
      s.transcript.push([text, "Working "]);
      save(params.sessionId, s);  // what a real agent does with a cancelled turn: it keeps it
      return { stopReason: "cancelled" };
    } else if (text === "mcp") {
      const server = (s.mcp || []).find((m) => m.type === "http" || m.url);
      await say(client, params.sessionId, `The user said ${server ? await askUser(server) : "nothing (no MCP server)"}`);
    } else if (text === "refuse") {
      await say(client, params.sessionId, "I will not ");
      return { stopReason: "refusal" };
    } else if (text === "limit") {
      await say(client, params.sessionId, "Cut short ");
      return { stopReason: "max_tokens" };
    } else if (text === "diff") {
      const oldText = Array.from({ length: 30 }, (_, i) => `line ${i + 1}`).join("\n") + "\n";
      await update(client, params.sessionId, { sessionUpdate: "tool_call", toolCallId: "edit-1", title: "Edit notes.txt",
        kind: "edit", status: "completed", locations: [{ path: "/work/notes.txt" }],
        content: [{ type: "diff", path: "/work/notes.txt", oldText, newText: oldText.replace("line 15\n", "line fifteen\n") }] });
      await update(client, params.sessionId, { sessionUpdate: "tool_call", toolCallId: "new-1", title: "Write new.txt",
        kind: "edit", status: "completed", locations: [{ path: "/work/new.txt" }],
        content: [{ type: "diff", path: "/work/new.txt", oldText: null, newText: "hello\nworld\n" }] });
      await update(client, params.sessionId, { sessionUpdate: "session_info_update", title: "Editing notes" });
      await update(client, params.sessionId, { sessionUpdate: "available_commands_update", availableCommands: [
        { name: "review", description: "Review the changes" },
        { name: "test", description: "Run the tests", input: { hint: "which tests" } }] });
      await say(client, params.sessionId, "Edited.");
    } else if (text === "fail") {
      throw new RequestError(-32603, "the fixture was told to fail");
    } else {
      const reply = `Turn ${s.turns}: ${text}`;
      await say(client, params.sessionId, reply);
      s.transcript.push([text, reply]);
    }
    save(params.sessionId, s);
    return { stopReason: "end_turn" };
  })
  .onRequest(methods.agent.session.setMode, async ({ params, client }) => {
    note({ "session/set_mode": params });
    await update(client, params.sessionId, { sessionUpdate: "current_mode_update", currentModeId: params.modeId });
    return {};
  })
  .onNotification(methods.agent.session.cancel, ({ params }) => {
    const s = sessions.get(params.sessionId);
    if (s && s.cancel) { s.cancel(); s.cancel = null; }
  });

app.connect(ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(process.stdin)));
