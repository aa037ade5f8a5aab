// How a message's text is shown in its bubble. The text comes from agents and hosts, so it is
// untrusted: it reaches the DOM only as textContent, or as markdown rendered by marked and then
// sanitized by DOMPurify into a DOM fragment (never innerHTML of a string). Each format keeps its
// element structure across updates (a message grows in place), so an opened <details> stays open.
import DOMPurify from "dompurify";
import { Marked } from "marked";

// "markdown": TEXT replies; "reasoning": a collapsed <details>; "command": a shell command;
// "command_output": its output so far; "tool": Cline's ClineSayTool JSON; "plain": anything else.
export type Format = "markdown" | "reasoning" | "command" | "command_output" | "tool" | "plain";

const marked = new Marked({
  gfm: true,
  breaks: false,
  // Task-list boxes as characters: the sanitizer admits no form controls.
  renderer: { checkbox: ({ checked }) => (checked ? "☑ " : "☐ ") },
});

const purify = DOMPurify(window);
// Links open in a new tab that cannot reach back to this page; a class survives only as a
// fenced block's `language-*` (so markdown cannot borrow the page's own classes, e.g. `toast`).
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.nodeType !== Node.ELEMENT_NODE) return;
  const e = node as Element;
  if (e.tagName === "A" && e.hasAttribute("href")) {
    e.setAttribute("target", "_blank");
    e.setAttribute("rel", "noopener noreferrer");
  }
  const cls = e.getAttribute("class");
  if (cls !== null) {
    const kept = cls.split(/\s+/).filter((c) => /^language-[\w+#.-]+$/.test(c)).join(" ");
    if (kept) e.setAttribute("class", kept);
    else e.removeAttribute("class");
  }
});
const PURIFY = {
  RETURN_DOM_FRAGMENT: true as const,
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "option", "dialog"],
  FORBID_ATTR: ["style", "id", "name", "autofocus"],
};

/** `text` as markdown, sanitized, as the children of `target`. */
export function renderMarkdown(target: HTMLElement, text: string): void {
  const html = marked.parse(text, { async: false }).trim(); // no trailing newline in textContent
  target.replaceChildren(purify.sanitize(html, PURIFY));
}

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls = "", text = ""): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text) e.textContent = text;
  return e;
}

/** The message body of `bubble` (an article with a header) rebuilt for `format`, if it had another. */
function body(bubble: HTMLElement, format: Format): HTMLElement {
  let b = bubble.querySelector<HTMLElement>(":scope > .body");
  if (b && bubble.dataset.format === format) return b;
  bubble.querySelectorAll(":scope > :not(header)").forEach((c) => c.remove());
  b = el("div", "body");
  if (format === "reasoning") {
    const details = el("details", "reasoning");
    details.append(el("summary", "", "Reasoning"), el("div", "text"));
    b.append(details);
  } else if (format === "command") {
    const pre = el("pre", "command");
    pre.append(el("code", "text"));
    b.append(pre);
  } else if (format === "command_output") {
    b.append(el("pre", "output text"));
  } else if (format !== "tool") {
    b.append(el("div", format === "markdown" ? "text md" : "text"));
  }
  const header = bubble.querySelector<HTMLElement>(":scope > header");
  if (header) header.hidden = format === "reasoning"; // its summary says what it is
  bubble.dataset.format = format;
  bubble.append(b);
  return b;
}

/** Shows `text` in `bubble` as `format`, replacing what it showed (the text is the whole message so far). */
export function renderBody(bubble: HTMLElement, format: Format, text: string): void {
  const b = body(bubble, format);
  if (format === "markdown") renderMarkdown(b.querySelector<HTMLElement>(".text")!, text);
  else if (format === "tool") renderTool(b, text);
  else if (format === "command_output") {
    const pre = b.querySelector<HTMLElement>(".output")!;
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = text;
    if (atEnd) pre.scrollTop = pre.scrollHeight; // follow the output unless scrolled back
  } else b.querySelector<HTMLElement>(".text")!.textContent = text;
}

// ClineSayTool fields shown in the tool's head (after its name and path) and, collapsed, below it.
const TOOL_FACTS = ["regex", "filePattern"] as const;
const TOOL_DETAILS = ["diff", "content"] as const;
const DIFF_OPEN_LINES = 40; // a diff this short shows open; a longer one starts collapsed

function toolInfo(text: string): Record<string, unknown> | null {
  try {
    const v: unknown = JSON.parse(text);
    if (v && typeof v === "object" && !Array.isArray(v) && typeof (v as { tool?: unknown }).tool === "string") {
      return v as Record<string, unknown>;
    }
  } catch {
    // not JSON (yet: a partial one grows into it): shown as plain text
  }
  return null;
}

function diffLines(text: string): DocumentFragment {
  const out = document.createDocumentFragment();
  for (const line of text.split("\n")) {
    const c = line[0];
    const cls = c === "+" && !line.startsWith("+++") ? "add" : c === "-" && !line.startsWith("---") ? "del"
      : line.startsWith("@@") ? "hunk" : "";
    out.append(el("span", cls, line || " "), "\n");
  }
  out.lastChild?.remove();
  return out;
}

function renderTool(b: HTMLElement, text: string): void {
  const info = toolInfo(text);
  const opened = new Set([...b.querySelectorAll<HTMLDetailsElement>("details[data-field]")]
    .filter((d) => d.open).map((d) => d.dataset.field));
  if (!info) {
    b.replaceChildren(el("div", "text", text));
    return;
  }
  const head = el("div", "tool-head");
  head.append(el("span", "tool-name", String(info.tool)));
  if (typeof info.path === "string" && info.path) head.append(el("code", "tool-path", info.path));
  for (const k of TOOL_FACTS) {
    const v = info[k];
    if (typeof v === "string" && v) head.append(el("span", "tool-fact", `${k}: ${v}`));
  }
  const parts: Node[] = [head];
  for (const k of TOOL_DETAILS) {
    const v = info[k];
    if (typeof v !== "string" || !v) continue;
    if (k === "content" && typeof info.diff === "string" && info.diff) continue; // the diff shows it
    const details = el("details", "tool-detail");
    details.dataset.field = k;
    const pre = el("pre", k === "diff" ? "diff" : "");
    if (k === "diff") pre.append(diffLines(v));
    else pre.textContent = v;
    const lines = v.replace(/\n$/, "").split("\n").length;
    // A short diff shows open; a long one (or any other detail) stays collapsed until clicked.
    details.open = opened.has(k) || (k === "diff" && lines <= DIFF_OPEN_LINES && !b.dataset.seen);
    let summary = `${k} · ${lines} line${lines === 1 ? "" : "s"}`;
    if (k === "diff") {
      const body = v.split("\n");
      const add = body.filter((l) => l.startsWith("+") && !l.startsWith("+++")).length;
      const del = body.filter((l) => l.startsWith("-") && !l.startsWith("---")).length;
      summary = `diff · +${add} −${del}`;
    }
    details.append(el("summary", "", summary), pre);
    parts.push(details);
  }
  b.replaceChildren(...parts);
  b.dataset.seen = "1"; // later updates keep what the user opened or closed
}
