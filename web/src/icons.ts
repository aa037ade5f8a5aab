// The page's icons, as inline SVG: no icon font and no emoji font needed (a 📎 without one is an
// empty box, on a desktop as on a phone). Each is a 24×24 stroke drawing in the text's color
// (`currentColor`), sized by CSS (`svg.icon`). index.html carries the same drawings inline for the
// buttons it has at load; tests/test_web_phone.py checks that no icon button shows a glyph instead.
const SVG = "http://www.w3.org/2000/svg";

// Each icon: the `d` of its paths (stroke only, round caps and joins).
export const ICONS = {
  menu: ["M4 6h16", "M4 12h16", "M4 18h16"],
  attach: ["M21 11.5l-8.6 8.6a5.5 5.5 0 0 1-7.8-7.8l8.6-8.6a3.7 3.7 0 0 1 5.2 5.2l-8.6 8.6a1.8 1.8 0 0 1-2.6-2.6l7.9-7.9"],
  close: ["M6 6l12 12", "M18 6L6 18"],
  panels: ["M4 4h16v16H4z", "M14 4v16"],
  branch: ["M6 3v12", "M18 9a3 3 0 1 0 0-6 3 3 0 0 0 0 6z", "M6 21a3 3 0 1 0 0-6 3 3 0 0 0 0 6z", "M18 9a9 9 0 0 1-9 9"],
} as const;
export type IconName = keyof typeof ICONS;

/** A new `<svg class="icon">` drawing `name`, hidden from screen readers (its button has a label). */
export function icon(name: IconName): SVGSVGElement {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", `icon icon-${name}`);
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  for (const d of ICONS[name]) {
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", d);
    svg.append(path);
  }
  return svg;
}

/** A button showing only `name`'s icon, named for screen readers and tooltips by `label`. */
export function iconButton(name: IconName, label: string, cls = "secondary"): HTMLButtonElement {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `${cls} icon-button`.trim();
  b.title = label;
  b.setAttribute("aria-label", label);
  b.append(icon(name));
  return b;
}
