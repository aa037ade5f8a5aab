// Bundles src/main.ts with esbuild and inlines it into src/index.html, writing the one
// self-contained page to ../server/static/index.html (served by GET / and getWebviewHtml, so it
// must work without any other asset).
import { build } from "esbuild";
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";

const result = await build({
  entryPoints: ["src/main.ts"],
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2022"],
  write: false,
  legalComments: "none",
});
const js = result.outputFiles[0].text.replace(/<\/script/gi, "<\\/script");
const template = readFileSync("src/index.html", "utf8");
const marker = "<!-- BUNDLE -->";
if (!template.includes(marker)) throw new Error(`src/index.html lacks ${marker}`);
const html = template.replace(marker, () => `<script>${js}</script>`);
mkdirSync("../server/static", { recursive: true });
writeFileSync("../server/static/index.html", html);
console.log(`server/static/index.html: ${html.length} bytes (script ${js.length})`);
