// The page's frame on any screen: the icons of the buttons index.html has at load (inline SVG,
// icons.ts), the side panel (Workspaces, widgets, Events) as a drawer on a phone, where it has no
// column of its own (#panels opens it, #panels-close or Escape closes it), and a placeholder that
// fits the message box (the long one where it fits on one line, a shorter one on a narrow screen).
import { ICONS, icon } from "./icons";
import type { IconName } from "./icons";

const LONG_PLACEHOLDER = "Message the agent (Enter to send, Shift+Enter for a new line)";
const SHORT_PLACEHOLDERS = ["Message the agent…", "Message…"];

/** Fills every `[data-icon]` element with its icon. */
export function drawIcons(root: ParentNode = document): void {
  for (const e of root.querySelectorAll<HTMLElement>("[data-icon]")) {
    const name = e.dataset.icon as IconName;
    if (name in ICONS) e.replaceChildren(icon(name));
  }
}

/** The width `text` takes in `box`'s font (a canvas measures it: no layout needed). */
export function textWidth(box: HTMLElement, text: string): number {
  const ctx = document.createElement("canvas").getContext("2d");
  if (!ctx) return 0;
  const s = getComputedStyle(box);
  ctx.font = `${s.fontStyle} ${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
  return ctx.measureText(text).width;
}

/** The room for text inside `box` (its content box). */
export function innerWidth(box: HTMLElement): number {
  const s = getComputedStyle(box);
  return box.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
}

function fitPlaceholder(input: HTMLTextAreaElement): void {
  const room = innerWidth(input);
  if (room <= 0) return; // not laid out (hidden): keep what it has
  const fits = [LONG_PLACEHOLDER, ...SHORT_PLACEHOLDERS].find((p) => textWidth(input, p) <= room);
  input.placeholder = fits ?? SHORT_PLACEHOLDERS[SHORT_PLACEHOLDERS.length - 1];
}

export function startLayout(input: HTMLTextAreaElement): void {
  drawIcons();
  const side = document.getElementById("side")!;
  const toggle = document.getElementById("panels") as HTMLButtonElement;
  const setOpen = (open: boolean) => {
    side.classList.toggle("open", open);
    toggle.setAttribute("aria-expanded", String(open));
  };
  toggle.addEventListener("click", () => setOpen(!side.classList.contains("open")));
  document.getElementById("panels-close")!.addEventListener("click", () => { setOpen(false); toggle.focus(); });
  document.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && side.classList.contains("open")) setOpen(false); });
  fitPlaceholder(input);
  new ResizeObserver(() => fitPlaceholder(input)).observe(input);
}
