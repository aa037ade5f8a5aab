// uibus webview: a browser page that talks gRPC-Web to the server that served it.
//
// It follows everything of its session — the UI streams, the extension UI, the sessions listing —
// over one multiplexed WebviewService stream (a browser allows only six HTTP/1.1 connections per
// server, shared by every tab of the page), renders Cline partial messages growing in
// place (replaced by `ts`; each SAY kind in its own block, render.ts), applies the theme, and
// chats with any agent the concierge lists. The stream starts with the session's state (recent
// messages, theme; marked `replayed`), so a page opened or reloaded mid-conversation shows the
// conversation so far.
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import type { Interceptor } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import { EmptyRequestSchema } from "./gen/cline/common_pb";
import { ClineAsk, ClineMessageType, ClineSay, UiService, WebviewProviderType } from "./gen/cline/ui_pb";
import type { ClineMessage } from "./gen/cline/ui_pb";
import { AgentService, ChatRequestSchema } from "./gen/neuro_san/api/grpc/agent_pb";
import { ChatMessage_ChatMessageType } from "./gen/neuro_san/api/grpc/chat_pb";
import { ConciergeService } from "./gen/neuro_san/api/grpc/concierge_pb";
import { ExtensionUiService } from "./gen/uibus/v1/extension_ui_pb";
import { SessionService } from "./gen/uibus/v1/sessions_pb";
import { WebviewService } from "./gen/uibus/v1/webview_pb";
import { AuditService } from "./gen/uibus/v1/audit_pb";
import { startAudit } from "./audit";
import { startControl } from "./control";
import { TeamService } from "./gen/uibus/v1/team_pb";
import { startRoles } from "./roles";
import { csrfValue, startSignin, watched } from "./signin";
import { startWorkspaces } from "./workspace";
import { extensionUi } from "./extui";
import { iconButton } from "./icons";
import { startLayout } from "./layout";
import { renderBody } from "./render";
import type { Format } from "./render";

const params = new URLSearchParams(location.search);
let session = params.get("session") || "default";
// The token (servers with --auth-token / --tokens-file): the URL fragment `#token=T` (never sent
// to a server), else the one the sign-in page kept for this tab, else `?token=T` (older links).
const TOKEN_KEY = "uibus-token";
const fragment = new URLSearchParams(location.hash.slice(1));
const token = fragment.get("token") || sessionStorage.getItem(TOKEN_KEY) || params.get("token") || "";
if (fragment.has("token")) {
  sessionStorage.setItem(TOKEN_KEY, token);
  fragment.delete("token");
  const rest = fragment.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
}
const server = params.get("server") || location.origin;
const clientId = params.get("client") || `webview-${Math.random().toString(36).slice(2, 10)}`;
// `?provider=TAB` subscribes as a TAB webview (typed history/settings/MCP clicks, as Cline's
// subscribeTo*ButtonClicked); anything else is SIDEBAR, Cline's default.
const provider = (params.get("provider") || "").toUpperCase() === "TAB" ? WebviewProviderType.TAB
  : WebviewProviderType.SIDEBAR;

const withSession: Interceptor = (next) => async (req) => {
  req.header.set("x-uibus-session", session);
  if (token) req.header.set("authorization", `Bearer ${token}`);
  else if (csrfValue()) req.header.set("x-uibus-csrf", csrfValue());  // signed in: the cookie's CSRF proof
  return token ? next(req) : watched(next(req));
};
const transport = createGrpcWebTransport({ baseUrl: server, interceptors: [withSession] });
void startSignin(token, server);  // who is signed in, "Sign out", expiry (signin.ts)
const ui = createClient(UiService, transport);
const webview = createClient(WebviewService, transport);
const concierge = createClient(ConciergeService, transport);

const $ = <T extends HTMLElement>(id: string): T => document.getElementById(id) as T;
const messages = $<HTMLElement>("messages");
const events = $<HTMLUListElement>("events");
const input = $<HTMLTextAreaElement>("input");
const agentSelect = $<HTMLSelectElement>("agent");
const form = $<HTMLFormElement>("chat");
const statusEl = $<HTMLElement>("status");
const themeName = $<HTMLElement>("theme-name");
$<HTMLElement>("session").textContent = session;
$<HTMLElement>("provider").textContent = WebviewProviderType[provider];
document.title = `uibus · ${session}`;
// Everything that follows the open session stops when this aborts (switching sessions).
let following = new AbortController();

// The stream's state, in the header's pill and — while nothing is shown yet — in the conversation
// (a spinner and "Connecting…" until the stream is live, rather than "Waiting for messages…").
function setStatus(state: "connecting" | "live" | "down", text: string): void {
  statusEl.dataset.state = state;
  statusEl.textContent = text;
  messages.dataset.state = state;
}

function logEvent(label: string, detail = ""): void {
  const li = document.createElement("li");
  const time = new Date().toLocaleTimeString();
  li.innerHTML = `<time></time><b></b><span></span>`;
  li.children[0].textContent = time;
  li.children[1].textContent = label;
  li.children[2].textContent = detail;
  li.dataset.event = label;
  events.prepend(li);
  while (events.children.length > 50) events.lastElementChild?.remove();
}

// ---- messages: one element per ts, replaced in place as the message grows -----------------------
const byTs = new Map<string, HTMLElement>();

// A SAY kind's name on the page (`data-say`): "text", "reasoning", "command", "command_output",
// "tool", "error", "user_feedback", … (ClineSay's name, lower case, without `_SAY`).
function sayName(say: ClineSay): string {
  return ClineSay[say]?.toLowerCase().replace(/_say$/, "") ?? String(say);
}

// A hosted agent's reply names its agent (model_info: provider "uibus", model the agent's name).
const AGENT_PROVIDER = "uibus";
function replyAgent(m: ClineMessage): string {
  const info = m.modelInfo;
  return m.type === ClineMessageType.SAY && m.say === ClineSay.TEXT && info?.providerId === AGENT_PROVIDER
    ? info.modelId : "";
}

// A bubble's heading: an agent's reply is headed with the agent's name, live (send) or replayed.
function messageLabel(m: ClineMessage): string {
  if (replyAgent(m)) return replyAgent(m);
  if (m.type === ClineMessageType.ASK) return `ask · ${ClineAsk[m.ask]?.toLowerCase() ?? m.ask}`;
  return sayName(m.say).replace(/_/g, " ");
}

// How a message's text is shown: agents' replies are markdown, the kinds coding agents publish
// while they work have their own blocks, everything else (questions, asks) is plain text.
function formatOf(m: ClineMessage): Format {
  if (m.type !== ClineMessageType.SAY) return "plain";
  switch (m.say) {
    case ClineSay.TEXT:
    case ClineSay.COMPLETION_RESULT_SAY:
    case ClineSay.INFO: return "markdown";  // e.g. an ACP agent's plan, a task list
    case ClineSay.REASONING: return "reasoning";
    case ClineSay.COMMAND_SAY: return "command";
    case ClineSay.COMMAND_OUTPUT_SAY: return "command_output";
    case ClineSay.TOOL_SAY: return "tool";
    default: return "plain";
  }
}

function bubble(kind: string, label: string, before: Element | null = null): HTMLElement {
  const el = document.createElement("article");
  el.className = `msg ${kind}`;
  const header = document.createElement("header");
  header.textContent = label;
  el.append(header);
  messages.insertBefore(el, before);
  return el;
}

function scrollDown(): void {
  messages.scrollTop = messages.scrollHeight;
}

// A chat sent from this page claims the partial messages the server mirrors from it (Chat → UI),
// so the reply grows in one bubble instead of showing twice.
let pendingChat: { el: HTMLElement; ts: string | null } | null = null;
// Questions asked from this page, not yet matched to the copy the server keeps (see showPartial).
const sentByMe: { text: string; el: HTMLElement }[] = [];
// Replies whose chat ended before the session's copy of them came (the page's one stream may lag the
// chat's): that copy, when it comes, is theirs — the reply shows once, headed as it was.
const lateReplies: { el: HTMLElement; agent: string; text: string }[] = [];

function showPartial(m: ClineMessage, replayed = false): void {
  const key = m.ts.toString();
  let el = byTs.get(key);
  const say = m.type === ClineMessageType.SAY;
  // A replayed message is history (a reconnect brings it again), never the reply being awaited;
  // the reply is a TEXT (an agent's reasoning, commands and tools are messages of their own).
  if (!el && !replayed && pendingChat && (pendingChat.ts === null || pendingChat.ts === key)
      && say && m.say === ClineSay.TEXT) {
    pendingChat.ts = key;
    el = pendingChat.el;
  }
  if (!el && !replayed && say && m.say === ClineSay.TEXT) {
    const i = lateReplies.findIndex((r) => r.agent === replyAgent(m)
      && (m.partial ? r.text.startsWith(m.text) : r.text === m.text));
    if (i >= 0) el = lateReplies.splice(i, 1)[0].el;
  }
  // A chat question (shown live to every UI of the session, and replayed): the "you" bubble this
  // page already shows for it, if it sent it (kept as drawn, with its attachments' names), else a new one.
  if (!el && say && m.say === ClineSay.USER_FEEDBACK) {
    const i = sentByMe.findIndex((s) => s.text === m.text);
    if (i >= 0) {
      const mine = sentByMe.splice(i, 1)[0].el;
      byTs.set(key, mine);
      mine.dataset.ts = key;
      mine.dataset.say = sayName(m.say);
      return;
    }
    el = bubble("user", "you");
  }
  // While a reply is awaited, what the agent does meanwhile shows above it (the reply stays last).
  if (!el) {
    const before = pendingChat?.el.isConnected ? pendingChat.el : null;
    const agent = replyAgent(m);
    el = bubble(agent ? "agent" : say ? "say" : "ask", messageLabel(m), before);
    if (agent) el.dataset.agent = agent;
  }
  byTs.set(key, el);
  el.dataset.ts = key;
  if (say) el.dataset.say = sayName(m.say);
  else el.dataset.ask = ClineAsk[m.ask]?.toLowerCase() ?? String(m.ask);
  el.classList.toggle("partial", m.partial);
  if (say && m.say === ClineSay.ERROR) el.classList.add("error");
  renderBody(el, formatOf(m), m.text || m.reasoning || "");
  scrollDown();
}

// ---- theme ----------------------------------------------------------------------------------------
// The palette a theme's kind selects (the CSS rules :root[data-kind=…] in index.html). Accepted:
// `kind` or `type` as "dark" | "light" | "high-contrast" ("hc", "hc-black") | "high-contrast-light"
// ("hc-light"), VS Code's uiTheme names ("vs", "vs-dark") and ColorThemeKind numbers (1-4).
type Kind = "dark" | "light" | "high-contrast" | "high-contrast-light";
const KIND_NUMBERS: Record<number, Kind> = { 1: "light", 2: "dark", 3: "high-contrast", 4: "high-contrast-light" };

function themeKind(raw: unknown): Kind | undefined {
  if (typeof raw === "number") return KIND_NUMBERS[raw];
  if (typeof raw !== "string") return undefined;
  const k = raw.trim().toLowerCase().replace(/[\s_]+/g, "-");
  if (!k) return undefined;
  const contrast = k.startsWith("hc") || k.includes("high-contrast") || k.includes("highcontrast");
  if (contrast) return k.includes("light") ? "high-contrast-light" : "high-contrast";
  if (k === "vs" || k.includes("light")) return "light";
  if (k.includes("dark") || k.includes("black")) return "dark";
  return undefined;
}

function applyTheme(json: string): void {
  document.body.dataset.theme = json;
  let theme: Record<string, unknown> = {};
  try {
    const parsed: unknown = JSON.parse(json);
    if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) theme = parsed as Record<string, unknown>;
  } catch {
    return;
  }
  const colors = (theme.colors ?? {}) as Record<string, string>;
  const pick = (...keys: string[]): string | undefined => {
    for (const k of keys) {
      const v = (colors[k] ?? theme[k]) as string | undefined;
      if (typeof v === "string" && v) return v;
    }
    return undefined;
  };
  const root = document.documentElement.style;
  const set = (name: string, value: string | undefined) => (value ? root.setProperty(name, value) : root.removeProperty(name));
  set("--bg", pick("editor.background", "background"));
  set("--fg", pick("editor.foreground", "foreground"));
  set("--panel", pick("sideBar.background", "panel"));
  set("--accent", pick("button.background", "focusBorder", "accent"));
  set("--border", pick("panel.border", "border"));
  // The kind picks the palette; explicit colors (inline on :root, just above) still win over it.
  const kind = themeKind(theme.kind ?? theme.type ?? theme.uiTheme);
  for (const target of [document.documentElement, document.body]) {
    if (kind) target.dataset.kind = kind;
    else delete target.dataset.kind;
  }
  themeName.textContent = String(theme.name || kind || "custom");
}

// ---- the one stream ---------------------------------------------------------------------------------
// Everything of the session comes over one WebviewService stream: the UI streams, the extension UI
// (dialogs, statuses, …) and the sessions listing. A browser keeps at most six HTTP/1.1 connections
// per server, and each open stream holds one: with a stream per kind, two or three tabs of the
// page used them all and a tap on Yes never left the browser. One stream per tab leaves the rest
// for the page's calls (chat, answers, steering).
//
// The cursor: the highest seq this page has had (messages and extension-UI events are stamped in
// the one session log). A reconnect resumes after it: the server sends exactly what changed since,
// not the whole snapshot again (docs/streams/resume.md). What a connection replays is taken into
// the cursor only once the server says the replay is whole (`replay_complete`): its parts arrive
// interleaved, so a connection cut halfway must not skip the part still to come.
let cursor = 0n;
// Restarts the stream (from the cursor) when the tab comes back: a phone's browser may have cut it
// in the background without the page noticing.
let restart: AbortController | null = null;
document.addEventListener("visibilitychange", () => { if (!document.hidden) restart?.abort(); });

async function follow(signal: AbortSignal): Promise<void> {
  for (let attempt = 0; !signal.aborted; attempt++) {
    const mine = new AbortController();
    const stop = () => mine.abort();
    signal.addEventListener("abort", stop);
    restart = mine;
    try {
      setStatus("connecting", "connecting…");
      const headers = cursor > 0n ? { "x-uibus-since": cursor.toString() } : undefined;
      if (cursor === 0n) extUi.reset(); // the stream starts from the session's state
      const stream = webview.subscribe({ clientId, providerType: provider, markReplayEnd: true, extensionUi: true,
                                         sessions: true }, { signal: mine.signal, headers });
      let first = true;
      let complete = false;
      let seen = cursor;
      const saw = (seq: bigint) => {
        if (seq > seen) seen = seq;
        if (complete && seq > cursor) cursor = seq;
      };
      await ui.initializeWebview(create(EmptyRequestSchema), { signal: mine.signal });
      for await (const ev of stream) {
        if (first) { first = false; attempt = 0; setStatus("live", "live"); } // its first event: live
        const e = ev.event;
        if (ev.replayComplete) {
          complete = true;
          if (seen > cursor) cursor = seen;
          continue;
        }
        if (ev.gap) logEvent("gap: the session's log no longer reaches back to what this page had");
        if (e.case === "partialMessage") {
          saw(e.value.seq);
          showPartial(e.value, ev.replayed);
        } else if (e.case === "extensionUi") {
          saw(e.value.seq);
          extUi.event(e.value);
        } else if (e.case === "sessions") control.listed(e.value.sessions);
        else if (ev.source === "subscribeToTheme" && e.case === "text") applyTheme(e.value);
        else if (ev.source === "subscribeToAddToInput" && e.case === "text") {
          input.value = input.value ? `${input.value}\n${e.value}` : e.value;
          input.dispatchEvent(new Event("input"));
          logEvent("add to input", e.value.slice(0, 60));
        } else if (ev.source === "subscribeToFocusChatInput") {
          input.focus();
          form.classList.add("flash");
          setTimeout(() => form.classList.remove("flash"), 600);
          logEvent("focus chat input");
        } else {
          logEvent(ev.source.replace(/^subscribeTo/, "").replace(/([a-z])([A-Z])/g, "$1 $2").toLowerCase());
        }
      }
      setStatus("down", "stream ended");
    } catch (err) {
      if (signal.aborted) return;
      if (mine.signal.aborted) { attempt = -1; continue; } // restarted: at once, from the cursor
      const e = ConnectError.from(err);
      setStatus("down", `disconnected: ${e.rawMessage || Code[e.code]}`);
      if (e.code === Code.Unauthenticated || e.code === Code.InvalidArgument) return;
    } finally {
      signal.removeEventListener("abort", stop);
      if (restart === mine) restart = null;
    }
    // Back in the foreground (a phone's browser cut the stream meanwhile): reconnect at once.
    await new Promise<void>((r) => {
      const wake = () => { if (!document.hidden) done(); };
      const done = () => { clearTimeout(t); document.removeEventListener("visibilitychange", wake); r(); };
      const t = setTimeout(done, Math.min(5000, 250 * 2 ** attempt));
      document.addEventListener("visibilitychange", wake);
    });
  }
}

// ---- chat -----------------------------------------------------------------------------------------
function agentClient(agent: string) {
  // neuro-san clients call /<agent>.AgentService/<Method>: the same service under a per-agent
  // name, so the descriptor is copied with that type name (connect builds the URL from it).
  const svc = { ...AgentService, typeName: `${agent}.AgentService` };
  svc.methods = AgentService.methods.map((m) => ({ ...m, parent: svc }));
  return createClient(svc as typeof AgentService, transport);
}

async function loadAgents(): Promise<void> {
  try {
    const res = await concierge.list({});
    agentSelect.replaceChildren(...res.agents.map((a) => {
      const o = document.createElement("option");
      o.value = a.agentName;
      o.textContent = a.agentName;
      o.title = a.description;
      return o;
    }));
    agentSelect.disabled = res.agents.length === 0;
    if (!res.agents.length) agentSelect.append(new Option("no agents", ""));
  } catch (err) {
    agentSelect.replaceChildren(new Option("agents unavailable", ""));
    agentSelect.disabled = true;
    logEvent("agent list failed", ConnectError.from(err).rawMessage);
  }
}

// ---- attachments: picked or pasted images and files, sent with the next message (mime_data) ----------
const attachments: { name: string; type: string; bytes: Uint8Array }[] = [];
const attachList = $<HTMLElement>("attachments");
const MAX_ATTACHMENT_BYTES = 2 * 1024 * 1024; // the whole request must stay within the server's 4 MiB

function showAttachments(): void {
  attachList.hidden = attachments.length === 0;
  attachList.replaceChildren(...attachments.map((a, i) => {
    const chip = document.createElement("span");
    chip.className = "attachment";
    chip.textContent = a.name;
    const drop = iconButton("close", `remove ${a.name}`, "");
    drop.addEventListener("click", () => { attachments.splice(i, 1); showAttachments(); });
    chip.append(drop);
    return chip;
  }));
}

async function attach(files: Iterable<File>): Promise<void> {
  for (const f of files) {
    if (f.size > MAX_ATTACHMENT_BYTES) { logEvent("attachment too large", `${f.name}: over 2 MiB`); continue; }
    attachments.push({ name: f.name || f.type, type: f.type || "application/octet-stream",
                       bytes: new Uint8Array(await f.arrayBuffer()) });
  }
  showAttachments();
}
const filePicker = $<HTMLInputElement>("file");
$<HTMLButtonElement>("attach").addEventListener("click", () => filePicker.click());
filePicker.addEventListener("change", () => { void attach(filePicker.files ?? []); filePicker.value = ""; });
input.addEventListener("paste", (ev) => {
  const files = [...(ev.clipboardData?.files ?? [])];
  if (files.length) { ev.preventDefault(); void attach(files); }
});

async function send(text: string): Promise<void> {
  const agent = agentSelect.value;
  if (!text.trim() || !agent) return;
  const files = attachments.splice(0);
  showAttachments();
  const mine = bubble("user", "you");
  renderBody(mine, "plain", files.length ? `${text}\n(attached: ${files.map((f) => f.name).join(", ")})` : text);
  sentByMe.push({ text, el: mine });
  const reply = bubble("agent partial", agent);
  renderBody(reply, "markdown", "");
  reply.dataset.agent = agent;
  pendingChat = { el: reply, ts: null };
  const button = form.querySelector<HTMLButtonElement>("button[type=submit]")!;
  button.disabled = true;
  scrollDown();
  let said = "";
  try {
    const request = create(ChatRequestSchema, { userMessage: { type: ChatMessage_ChatMessageType.HUMAN, text,
      mimeData: files.map((f) => ({ mimeType: f.type, mimeBytes: f.bytes })) } });
    for await (const res of agentClient(agent).streamingChat(request)) {
      const m = res.response;
      if (m && m.text && (m.type === ChatMessage_ChatMessageType.AGENT_FRAMEWORK || m.type === ChatMessage_ChatMessageType.AI)) {
        renderBody(reply, "markdown", m.text);
        said = m.text;
        scrollDown();
      }
    }
    reply.classList.remove("partial");
    reply.classList.add("done");
    if (pendingChat?.el === reply && pendingChat.ts === null) {
      lateReplies.push({ el: reply, agent, text: said });
      lateReplies.splice(0, lateReplies.length - 8); // a reply whose copy never comes is forgotten in time
    }
  } catch (err) {
    reply.classList.remove("partial");
    reply.classList.add("error");
    renderBody(reply, "plain", `error: ${ConnectError.from(err).rawMessage}`);
  } finally {
    if (pendingChat?.el === reply) pendingChat = null;
    button.disabled = false;
  }
}

form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = input.value;
  input.value = "";
  void send(text);
});
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    form.requestSubmit();
  }
});

const extUi = extensionUi(createClient(ExtensionUiService, transport), {
  dialogs: $<HTMLElement>("dialogs"), statuses: $<HTMLElement>("statuses"), widgets: $<HTMLElement>("widgets"),
  title: $<HTMLElement>("ext-title"), input, log: logEvent,
});
function followSession(): void {
  void follow(following.signal);
}

// Another session, without a reload: the open one's streams end, its messages and dialogs go,
// and the new one's state (recent messages, waiting dialogs) comes with its first events.
function switchTo(name: string, push = true): void {
  if (name === session) return;
  following.abort();
  following = new AbortController();
  session = name;
  byTs.clear();
  sentByMe.length = 0;
  lateReplies.length = 0;
  pendingChat = null;
  messages.replaceChildren();
  cursor = 0n; // the new session's log: from its state, not from a seq of the old one's
  extUi.reset();
  $<HTMLElement>("session").textContent = session;
  document.title = `uibus · ${session}`;
  if (push) {
    const url = new URL(location.href);
    url.searchParams.set("session", session);
    history.pushState(null, "", url);
  }
  logEvent("session", session);
  followSession();
  control.sessionChanged();
  audit.sessionChanged();
  roles.sessionChanged();
}
addEventListener("popstate", () => switchTo(new URLSearchParams(location.search).get("session") || "default", false));

const sessionsClient = createClient(SessionService, transport);
const workspaces = startWorkspaces({
  sessions: sessionsClient, panel: $<HTMLElement>("workspaces"), list: $<HTMLElement>("workspace-list"),
  diff: $<HTMLElement>("workspace-diff"), log: logEvent,
});
const control = startControl({
  sessions: sessionsClient, current: () => session, switchTo, log: logEvent, onSession: workspaces.show,
  list: $<HTMLUListElement>("session-list"), drawer: $<HTMLElement>("sessions"), newButton: $<HTMLButtonElement>("new-session"),
  menuButton: $<HTMLButtonElement>("menu"), agentSelect, input, stop: $<HTMLButtonElement>("stop"),
  mode: $<HTMLSelectElement>("mode"), model: $<HTMLSelectElement>("model"), commands: $<HTMLElement>("commands"),
});
const audit = startAudit({ audit: createClient(AuditService, transport), current: () => session, log: logEvent,
                           header: document.querySelector<HTMLElement>("body > header")! });  // audit.ts
const roles = startRoles({ team: createClient(TeamService, transport), current: () => session, log: logEvent,
                          dialogs: $<HTMLElement>("dialogs") });  // what this person may do here (roles.ts)
startLayout(input);
followSession();
void loadAgents().then(() => control.sessionChanged());
