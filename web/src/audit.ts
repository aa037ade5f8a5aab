// The audit view: who did what in the open session — time, who (and through which door), the act,
// and for an answered dialog the question and the answer — as uibus.v1.AuditService/List returns
// the session's entries (docs/security/audit.md), with filters by person, act and time.
//
// Shown only to those who may read it: the server decides (a token that may use every session, or
// the session's owner), so the view asks once per session (List, one entry) and shows its button
// only when that call is answered. Refused (not the owner, signed out, no audit log), the view says
// so in the events list and in its own place, and hides itself; the next session is asked again.
// Every text here comes from callers (questions, names, clients): shown through textContent only.
import { Code, ConnectError } from "@connectrpc/connect";
import type { Client } from "@connectrpc/connect";
import type { JsonObject } from "@bufbuild/protobuf";
import { AuditService } from "./gen/uibus/v1/audit_pb";
import type { AuditEntry } from "./gen/uibus/v1/audit_pb";
import { iconButton } from "./icons";

export type AuditView = {
  audit: Client<typeof AuditService>;
  current: () => string;
  header: HTMLElement; // where the "Audit" button goes (before the status pill)
  log: (label: string, detail?: string) => void;
};

const PAGE = 200; // entries shown at most (the newest)
const REFRESH_MS = 5000; // while open and visible, the list is asked again this often

// The acts the filter offers (an entry of `dialog.` matches every act starting so).
const ACTS: [string, string][] = [
  ["", "every act"], ["dialog.", "dialogs (all)"], ["dialog.approve", "approved"], ["dialog.deny", "denied"],
  ["dialog.answer", "answered"], ["steer.", "steering"], ["session.", "sessions"], ["workspace.", "workspaces"],
  ["token.mint", "tokens minted"], ["invite.", "invites"], ["role.set", "roles"],
];

const CSS = `
#audit-view { position: fixed; z-index: 20; top: 52px; right: 12px; bottom: 12px; width: min(860px, calc(100vw - 24px));
  display: flex; flex-direction: column; gap: 8px; padding: 12px; background: var(--panel);
  border: 1px solid var(--border); border-radius: 10px; box-shadow: 0 8px 28px rgb(0 0 0 / .35); }
#audit-view h2 { margin: 0; font-size: 13px; text-transform: uppercase; letter-spacing: .08em; color: var(--muted); }
.audit-head, .audit-filters { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; }
.audit-head h2 { flex: 1; }
.audit-filters input, .audit-filters select { padding: 4px 8px; font-size: 12px; }
.audit-filters input, .audit-filters select { color: var(--fg); background: var(--bg); border: 1px solid var(--border);
  border-radius: 6px; font: inherit; }
#audit-note { color: var(--muted); font-size: 12px; }
#audit-note[data-refused] { color: #f85149; }
.audit-list { overflow: auto; flex: 1; }
.audit-list table { width: 100%; border-collapse: collapse; font-size: 12px; }
.audit-list th { text-align: left; color: var(--muted); font-weight: 500; position: sticky; top: 0; background: var(--panel); }
.audit-list td, .audit-list th { padding: 4px 6px; border-bottom: 1px solid var(--border); vertical-align: top; }
.audit-list td.a-what { overflow-wrap: anywhere; }
.audit-list .a-door { color: var(--muted); }
.audit-list tr[data-act="dialog.approve"] .a-act { color: #3fb950; }
.audit-list tr[data-act="dialog.deny"] .a-act { color: #f85149; }
`;

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls = "", text = ""): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

function text(detail: JsonObject | undefined, key: string): string {
  const v = detail?.[key];
  return v === undefined || v === null ? "" : String(v);
}

/** What an entry was about, in a line: a dialog's question and its answer, else its other facts. */
export function what(e: AuditEntry): string {
  const d = e.detail;
  if (e.act.startsWith("dialog.")) {
    const question = [text(d, "title"), text(d, "message")].filter(Boolean).join(" — ");
    const answer = text(d, "answer") === "value" ? `“${text(d, "value")}”` : text(d, "answer");
    const options = text(d, "options") ? ` (of ${text(d, "options")})` : "";
    return `${question || text(d, "kind")} → ${answer}${options}${d?.forwarded ? " · forwarded" : ""}`;
  }
  return Object.entries(d ?? {}).map(([k, v]) => `${k}: ${String(v)}`).join(" · ");
}

export function startAudit(v: AuditView): { sessionChanged: () => void } {
  const style = el("style");
  style.textContent = CSS;
  document.head.append(style);
  const toggle = el("button", "secondary", "Audit");
  toggle.type = "button";
  toggle.id = "audit-toggle";
  toggle.title = "who approved, denied, stopped, deleted in this session (the audit log)";
  toggle.hidden = true;
  v.header.insertBefore(toggle, v.header.querySelector("#status"));

  const view = el("section");
  view.id = "audit-view";
  view.hidden = true;
  view.setAttribute("aria-label", "audit log");
  const head = el("div", "audit-head");
  const close = iconButton("close", "close the audit log");
  head.append(el("h2", "", "Audit log"), close);
  const person = el("input");
  person.id = "audit-person";
  person.placeholder = "person";
  const act = el("select");
  act.id = "audit-act";
  for (const [value, label] of ACTS) act.append(new Option(label, value));
  const since = el("input");
  since.id = "audit-since";
  since.type = "datetime-local";
  since.title = "entries at or after this time";
  const filters = el("div", "audit-filters");
  filters.append(person, act, since);
  const note = el("div");
  note.id = "audit-note";
  const list = el("div", "audit-list");
  view.append(head, filters, note, list);
  document.body.append(view);

  let asked = ""; // the session whose readability is known (or being asked)
  let timer: ReturnType<typeof setTimeout> | undefined;
  let generation = 0; // bumped on every session change: an answer for the old session is dropped

  function refused(err: unknown): void {
    const e = ConnectError.from(err);
    const why = e.code === Code.PermissionDenied ? "not yours to read (the session's owner, or a token for every session)"
      : e.code === Code.Unimplemented ? "this server keeps no audit log" : e.rawMessage || Code[e.code];
    note.textContent = `The audit log is not shown: ${why}`;
    note.dataset.refused = Code[e.code];
    view.dataset.state = "refused";
    list.replaceChildren();
    filters.hidden = true;
    toggle.hidden = true;
    v.log("audit hidden", why);
    setTimeout(() => { if (view.dataset.state === "refused") view.hidden = true; }, 4000);
  }

  function render(entries: AuditEntry[]): void {
    const table = el("table");
    const header = el("tr");
    for (const h of ["time", "who", "door", "act", "what"]) header.append(el("th", "", h));
    table.append(el("thead"));
    table.tHead!.append(header);
    const body = el("tbody");
    for (const e of entries.slice().reverse()) { // newest first
      const tr = el("tr");
      tr.dataset.seq = e.seq.toString();
      tr.dataset.act = e.act;
      tr.dataset.who = e.who;
      const when = el("td", "a-time", new Date(e.time).toLocaleString());
      when.title = e.time;
      const who = el("td", "a-who", e.who);
      who.title = [e.tenant && `tenant ${e.tenant}`, e.client && `client ${e.client}`].filter(Boolean).join(" · ");
      tr.append(when, who, el("td", "a-door", e.door), el("td", "a-act", e.act), el("td", "a-what", what(e)));
      body.append(tr);
    }
    table.append(body);
    list.replaceChildren(table);
    note.textContent = entries.length ? `${entries.length} entr${entries.length === 1 ? "y" : "ies"}` +
      (entries.length >= PAGE ? ` (the first ${PAGE} matching; narrow the filters)` : "") : "No entries match.";
    delete note.dataset.refused;
  }

  async function load(): Promise<void> {
    const mine = generation;
    const sinceMs = since.value ? new Date(since.value).getTime() : 0;
    try {
      const page = await v.audit.list({ person: person.value.trim(), act: act.value,
                                        sinceMs: BigInt(Number.isFinite(sinceMs) ? sinceMs : 0), limit: PAGE });
      if (mine !== generation) return;
      view.dataset.state = "shown";
      render(page.entries);
    } catch (err) {
      if (mine === generation) refused(err);
    }
  }

  function schedule(): void {
    clearTimeout(timer);
    if (view.hidden) return;
    timer = setTimeout(() => { if (!document.hidden && !view.hidden) void load().then(schedule); else schedule(); },
                       REFRESH_MS);
  }

  function open(): void {
    view.hidden = false;
    filters.hidden = false;
    note.textContent = "loading…";
    void load().then(schedule);
  }

  toggle.addEventListener("click", () => { if (view.hidden) open(); else { view.hidden = true; clearTimeout(timer); } });
  close.addEventListener("click", () => { view.hidden = true; clearTimeout(timer); });
  for (const input of [person, act, since]) input.addEventListener("change", () => void load());
  person.addEventListener("keydown", (ev) => { if (ev.key === "Enter") void load(); });

  // Whether this session's audit may be read by this page: one entry asked; the button shows on an answer.
  async function probe(): Promise<void> {
    const session = v.current();
    if (session === asked) return;
    asked = session;
    const mine = ++generation;
    toggle.hidden = true;
    try {
      await v.audit.list({ limit: 1 });
      if (mine !== generation) return;
      toggle.hidden = false;
      view.dataset.state = "ready";
      if (!view.hidden) open();
    } catch (err) {
      if (mine === generation) refused(err);
    }
  }

  void probe();
  return { sessionChanged: () => void probe() };
}
