// The control room: every session of this token at a glance (the listing the page's one stream
// carries, as SessionService/WatchSessions sends it), switching between
// them without a reload, a new session, and — for the open session — Stop, the agent's mode and
// model pickers and `/` command completion where the agent offers them. Attention: when a dialog
// waits in a session this tab does not show (another session, or the tab is hidden), the tab's
// title carries the count and a browser notification names the agent and the question; a click
// on it opens that session, where the dialog takes the focus. Answering anywhere clears it
// everywhere, because the counts come from the server's list.
import { ConnectError } from "@connectrpc/connect";
import type { Client } from "@connectrpc/connect";
import { SessionService } from "./gen/uibus/v1/sessions_pb";
import type { AgentState, SessionEntry } from "./gen/uibus/v1/sessions_pb";
import { icon } from "./icons";

export type Control = {
  sessions: Client<typeof SessionService>;
  current: () => string;
  switchTo: (session: string) => void;
  list: HTMLUListElement;
  drawer: HTMLElement;
  newButton: HTMLButtonElement;
  menuButton: HTMLButtonElement;
  agentSelect: HTMLSelectElement;
  input: HTMLTextAreaElement;
  stop: HTMLButtonElement;
  mode: HTMLSelectElement;
  model: HTMLSelectElement;
  commands: HTMLElement;
  log: (label: string, detail?: string) => void;
  // Told the open session's entry whenever the list or the session changes (its workspaces: ./workspace.ts).
  onSession?: (entry: SessionEntry | undefined, session: string) => void;
};

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls = "", text = ""): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

export function status(e: SessionEntry): "waiting" | "running" | "idle" {
  return e.waitingDialogs > 0 ? "waiting" : e.running.length ? "running" : "idle";
}

export function startControl(c: Control): { sessionChanged: () => void; listed: (sessions: SessionEntry[]) => void } {
  let entries: SessionEntry[] = [];
  const seen = new Map<string, Set<string>>(); // session -> dialog ids already announced
  let first = true; // the first list: what waits already is counted, never announced
  const chosenAgent = new Set<string>(); // sessions whose agent this page already selected
  const baseTitle = () => `uibus · ${c.current()}`;

  // Notification permission: asked once, on the first click or key press (never on load).
  const ask = () => {
    if ("Notification" in window && Notification.permission === "default") void Notification.requestPermission();
  };
  document.addEventListener("pointerdown", ask, { once: true });
  document.addEventListener("keydown", ask, { once: true });

  const current = (): SessionEntry | undefined => entries.find((e) => e.session === c.current());
  const agentState = (): AgentState | undefined => current()?.agents.find((a) => a.agent === c.agentSelect.value);

  function announce(e: SessionEntry, title: string): void {
    const who = e.running[0] || e.agent || "an agent";
    c.log("attention", `${e.session}: ${title}`);
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    const n = new Notification(`${who} asks (${e.title || e.session})`, { body: title, tag: `uibus-${e.session}` });
    n.onclick = () => {
      window.focus();
      c.switchTo(e.session);
      n.close();
    };
  }

  function attention(): void {
    const here = c.current();
    let count = 0;
    for (const e of entries) {
      const elsewhere = document.hidden || e.session !== here;
      if (elsewhere) count += e.waitingDialogs;
      const known = seen.get(e.session) ?? new Set<string>();
      for (const d of e.waiting) {
        if (!known.has(d.id) && !first && elsewhere) announce(e, d.title);
        known.add(d.id);
      }
      for (const id of known) if (!e.waiting.some((d) => d.id === id)) known.delete(id);
      seen.set(e.session, known);
    }
    first = false;
    document.title = count ? `(${count}) ${baseTitle()}` : baseTitle();
  }

  function renderList(): void {
    const here = c.current();
    const items = entries.map((e) => {
      const li = el("li");
      li.dataset.session = e.session;
      li.dataset.status = status(e);
      if (e.session === here) li.classList.add("current");
      const dot = el("span", "dot");
      dot.title = status(e);
      const title = el("span", "s-title", e.title || e.session);
      const name = el("small", "s-name", e.session);
      li.append(dot, title);
      if (e.waitingDialogs) li.append(el("b", "count", String(e.waitingDialogs)));
      li.append(name);
      for (const w of e.workspaces) { // each agent's branch and what it changed (agents with their own worktree)
        const ws = el("small", "s-ws", `${w.agent} +${w.linesAdded} −${w.linesRemoved}`);
        ws.prepend(icon("branch"));
        ws.title = `${w.branch}: ${w.filesChanged} file(s) changed`;
        li.append(ws);
      }
      li.tabIndex = 0;
      const open = () => { c.drawer.classList.remove("open"); c.switchTo(e.session); };
      li.addEventListener("click", open);
      li.addEventListener("keydown", (ev) => { if (ev.key === "Enter") open(); });
      return li;
    });
    if (!entries.some((e) => e.session === here)) { // the open session, even before it has anything stored
      const li = el("li", "current");
      li.dataset.session = here;
      li.dataset.status = "idle";
      li.append(el("span", "dot"), el("span", "s-title", here));
      items.unshift(li);
    }
    c.list.replaceChildren(...items);
  }

  function fill(select: HTMLSelectElement, items: { id: string; name: string }[], value: string): void {
    select.hidden = items.length === 0;
    if (select.hidden) return;
    const key = items.map((i) => i.id).join("\n");
    if (select.dataset.items !== key) {
      select.replaceChildren(...items.map((i) => new Option(i.name, i.id)));
      select.dataset.items = key;
    }
    if (document.activeElement !== select) select.value = value;
  }

  function renderSession(): void {
    const e = current();
    if (e && e.agent && !chosenAgent.has(e.session)) { // the session opens on the agent it talks to
      if ([...c.agentSelect.options].some((o) => o.value === e.agent)) {
        c.agentSelect.value = e.agent;
        chosenAgent.add(e.session);
      }
    }
    const a = agentState();
    c.stop.hidden = !(e && e.running.includes(c.agentSelect.value));
    fill(c.mode, a?.modes ?? [], a?.currentMode ?? "");
    fill(c.model, a?.models ?? [], a?.currentModel ?? "");
    completeCommands();
    c.onSession?.(e, c.current());
  }

  function render(): void {
    renderList();
    renderSession();
    attention();
  }

  function completeCommands(): void {
    const text = c.input.value;
    const commands = agentState()?.commands ?? [];
    const m = /^\/(\S*)$/.exec(text);
    const matches = m ? commands.filter((k) => k.name.startsWith(m[1])).slice(0, 8) : [];
    c.commands.replaceChildren(...matches.map((k) => {
      const b = el("button", "secondary command-option", `/${k.name}`);
      b.type = "button";
      if (k.description) b.title = k.description;
      b.addEventListener("click", () => {
        c.input.value = `/${k.name} `;
        c.input.focus();
        completeCommands();
      });
      return b;
    }));
    c.commands.hidden = matches.length === 0;
  }

  async function call(what: string, run: () => Promise<unknown>): Promise<void> {
    try {
      await run();
    } catch (err) {
      c.log(`${what} failed`, ConnectError.from(err).rawMessage);
    }
  }

  c.stop.addEventListener("click", () => void call("stop", () => c.sessions.stopTurn({ agent: c.agentSelect.value })));
  c.mode.addEventListener("change", () =>
    void call("mode", () => c.sessions.setMode({ agent: c.agentSelect.value, modeId: c.mode.value })));
  c.model.addEventListener("change", () =>
    void call("model", () => c.sessions.setModel({ agent: c.agentSelect.value, modelId: c.model.value })));
  c.agentSelect.addEventListener("change", renderSession);
  c.input.addEventListener("input", completeCommands);
  c.input.addEventListener("keydown", (ev) => {
    const firstOption = c.commands.querySelector<HTMLButtonElement>("button");
    if (ev.key === "Tab" && firstOption && !c.commands.hidden) {
      ev.preventDefault();
      firstOption.click();
    }
  });
  c.menuButton.addEventListener("click", () => c.drawer.classList.toggle("open"));
  c.newButton.addEventListener("click", () => {
    const name = `s-${Date.now().toString(36)}`;
    c.drawer.classList.remove("open");
    c.switchTo(name);
    void call("new session", () => c.sessions.createSession({}));
  });

  document.addEventListener("visibilitychange", () => { if (!document.hidden) attention(); });
  // Each listing the page's one stream brings (WebviewService with `sessions`: the sessions this
  // token may see, sent whole on every change; the stream reconnects, so this needs no loop).
  function listed(sessions: SessionEntry[]): void {
    entries = sessions;
    render();
  }
  return { sessionChanged: render, listed };
}
