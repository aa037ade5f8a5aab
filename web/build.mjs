// Bundles src/main.ts with esbuild and inlines it into src/index.html, writing the one
// self-contained page to ../server/static/index.html (served by GET / and getWebviewHtml, so it
// must work without any other asset). UIBUS_PAGE_OUT writes it elsewhere (relative to web/):
// tests/test_web_build.py builds into a temporary file and compares it with the committed page,
// so the build must be deterministic (same sources, same bytes).
import { build } from "esbuild";
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { dirname, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const web = dirname(fileURLToPath(import.meta.url));
const out = resolve(web, process.env.UIBUS_PAGE_OUT || "../server/static/index.html");

const result = await build({
  absWorkingDir: web,
  entryPoints: ["src/main.ts"],
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2022"],
  write: false,
  legalComments: "none",
});
const js = result.outputFiles[0].text.replace(/<\/script/gi, "<\\/script");
const template = readFileSync(resolve(web, "src/index.html"), "utf8");
const marker = "<!-- BUNDLE -->";
if (!template.includes(marker)) throw new Error(`src/index.html lacks ${marker}`);
const html = template.replace(marker, () => `<script>${js}</script>`);
mkdirSync(dirname(out), { recursive: true });
writeFileSync(out, html);
const shown = relative(resolve(web, ".."), out);
console.log(`${shown.startsWith("..") ? out : shown}: ${html.length} bytes (script ${js.length})`);
