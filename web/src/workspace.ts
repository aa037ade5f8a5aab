// The workspaces of the open session (agents with option workspace = "worktree": each works in a
// git repository of its own, on its own branch): each agent's branch and what changed against its
// base, as the session list reports it, on request the changed files and the unified diff
// (SessionService.GetWorkspaceDiff, capped by the server with a marker line), and an export of the
// work as a branch of the base repository (SessionService.ExportWorkspace). The diff is text from
// an agent's files: shown only through textContent, never as HTML.
import { ConnectError } from "@connectrpc/connect";
import type { Client } from "@connectrpc/connect";
import { SessionService } from "./gen/uibus/v1/sessions_pb";
import type { SessionEntry, Workspace, WorkspaceDiff } from "./gen/uibus/v1/sessions_pb";
import { icon, iconButton } from "./icons";

export type WorkspaceView = {
  sessions: Client<typeof SessionService>;
  panel: HTMLElement; // hidden while the open session has no workspace
  list: HTMLElement;
  diff: HTMLElement;
  log: (label: string, detail?: string) => void;
};

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls = "", text = ""): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

/** "2 files +10 −3 · 1 commit": what a workspace changed, in a line. */
export function changes(w: Workspace): string {
  if (w.error) return "unreadable";
  const files = `${w.filesChanged} file${w.filesChanged === 1 ? "" : "s"} +${w.linesAdded} −${w.linesRemoved}`;
  return w.commits ? `${files} · ${w.commits} commit${w.commits === 1 ? "" : "s"}` : files;
}

const key = (w: Workspace): string => [w.branch, w.filesChanged, w.linesAdded, w.linesRemoved, w.commits].join(" ");

export function startWorkspaces(v: WorkspaceView): { show: (entry: SessionEntry | undefined, session: string) => void } {
  let session = "";
  let open = ""; // the agent whose diff is shown
  let openKey = ""; // what its summary said when it was fetched (a change fetches it again)
  let loading = 0;

  function renderDiff(d: WorkspaceDiff, agent: string): void {
    const head = el("div", "ws-head");
    head.append(el("b", "", `${agent}: ${d.workspace?.branch ?? ""}`));
    const close = iconButton("close", "close the diff");
    close.addEventListener("click", () => { open = ""; v.diff.hidden = true; v.diff.replaceChildren(); });
    const exp = el("button", "secondary ws-export", "Export…");
    exp.type = "button";
    exp.title = "make this work a branch of the base repository (nothing of the agent's runs)";
    exp.addEventListener("click", () => void exportTo(agent, d.workspace?.branch ?? ""));
    head.append(exp, close);
    const files = el("ul", "ws-files");
    for (const f of d.files) {
      const li = el("li");
      li.append(el("span", "ws-path", f.path), el("span", "ws-n", f.binary ? "binary" : `+${f.linesAdded} −${f.linesRemoved}`));
      files.append(li);
    }
    const pre = el("pre", "diff ws-diff");
    for (const line of d.diff.split("\n")) {
      const cls = line.startsWith("+") && !line.startsWith("+++") ? "add"
        : line.startsWith("-") && !line.startsWith("---") ? "del" : "";
      pre.append(el("span", cls, line + "\n"));
    }
    if (!d.diff) pre.textContent = "no changes";
    v.diff.replaceChildren(head, files, pre);
    if (d.truncated) v.diff.append(el("p", "ws-note", "The diff was cut; the rest is on the branch."));
    v.diff.hidden = false;
  }

  async function exportTo(agent: string, branch: string): Promise<void> {
    const name = window.prompt("Export to the base repository as branch:", branch);
    if (name === null) return;
    try {
      const r = await v.sessions.exportWorkspace({ agent, branch: name.trim() });
      v.log("workspace exported", `${agent} → ${r.branch} (${r.commit.slice(0, 12)})`);
    } catch (err) {
      v.log("workspace export failed", ConnectError.from(err).rawMessage);
    }
  }

  async function load(agent: string, summary: string): Promise<void> {
    const mine = ++loading;
    const from = session;
    open = agent;
    openKey = summary;
    try {
      const d = await v.sessions.getWorkspaceDiff({ agent });
      if (mine === loading && from === session && open === agent) renderDiff(d, agent);
    } catch (err) {
      v.log("workspace diff failed", ConnectError.from(err).rawMessage);
    }
  }

  function show(entry: SessionEntry | undefined, now: string): void {
    if (now !== session) { // another session: its own workspaces, no diff open
      session = now;
      open = "";
      v.diff.hidden = true;
      v.diff.replaceChildren();
    }
    const spaces = entry?.workspaces ?? [];
    v.panel.hidden = spaces.length === 0;
    v.list.replaceChildren(...spaces.map((w) => {
      const row = el("div", "ws-row");
      row.dataset.agent = w.agent;
      const b = el("button", "secondary ws-open", `${w.agent} `);
      b.append(icon("branch"), w.branch);
      b.type = "button";
      b.title = `base ${w.base.slice(0, 12)}${w.error ? ` (${w.error})` : ""}: show the diff`;
      b.addEventListener("click", () => void load(w.agent, key(w)));
      row.append(b, el("span", "ws-changes", changes(w)));
      return row;
    }));
    const shown = spaces.find((w) => w.agent === open);
    if (!shown && open) { open = ""; v.diff.hidden = true; v.diff.replaceChildren(); }
    if (shown && key(shown) !== openKey) void load(shown.agent, key(shown)); // it changed: the diff again
  }

  return { show };
}
