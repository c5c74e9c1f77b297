// Open nbconvert HTML pages in headless Debian chromium with every non-local request blocked, and check that
// each widget output was rendered by the widget manager: a %%vram report (.vram-widget: before, after and peak
// bars) or a %vram_estimate one (.vram-estimate-widget: at least one bar), whose segments all have a visible size.
// Saves a full-page screenshot of each page.
//
// usage: node check.mjs BASE_URL OUT_DIR PAGE.html [PAGE.html ...]
//   BASE_URL  e.g. http://127.0.0.1:8765/ (a local server of the folder with the pages, embed-amd.js, require.js)
//   OUT_DIR   where the screenshots go
// env: CHROMIUM (default /usr/bin/chromium)

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [base, outDir, ...pages] = process.argv.slice(2);
if (!base || !outDir || pages.length === 0) {
  console.error("usage: node check.mjs BASE_URL OUT_DIR PAGE.html [PAGE.html ...]");
  process.exit(2);
}

const LOCAL_HOSTS = new Set(["127.0.0.1", "localhost", "[::1]"]);

function isLocal(url) {
  const u = new URL(url);
  if (u.protocol === "data:" || u.protocol === "blob:" || u.protocol === "about:") return true;
  if (u.protocol === "file:") return true;
  return LOCAL_HOSTS.has(u.hostname);
}

const profile = mkdtempSync(join(tmpdir(), "vram-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1100, height: 900 },
  args: [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
  ],
});

const blocked = new Set();
await context.route("**/*", (route) => {
  const url = route.request().url();
  if (isLocal(url)) return route.continue();
  blocked.add(new URL(url).origin);
  return route.abort("blockedbyclient");
});

let failures = 0;
for (const name of pages) {
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (err) => errors.push(String(err)));
  const started = Date.now();
  await page.goto(new URL(name, base).href, { waitUntil: "load" });

  // nbconvert writes one <script type="application/vnd.jupyter.widget-view+json"> per widget output; the widget
  // manager replaces each with the rendered view.
  const expected = await page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count();
  let result;
  try {
    await page.waitForFunction(
      (n) => document.querySelectorAll(".vram-widget, .vram-estimate-widget").length >= n,
      expected,
      { timeout: 20000 },
    );
    result = await page.evaluate(() => {
      const widgets = [...document.querySelectorAll(".vram-widget, .vram-estimate-widget")];
      return widgets.map((w) => {
        const kind = w.classList.contains("vram-widget") ? "report" : "estimate";
        const bars = [...w.querySelectorAll(".vram-bar")];
        const segs = [...w.querySelectorAll(".vram-seg")];
        // Each segment is drawn as wide as its share says (within a pixel and a half); a share too small to
        // see may collapse to nothing, but a visible one must be there.
        const visible = segs.filter((s) => {
          const r = s.getBoundingClientRect();
          const bar = s.closest(".vram-bar").getBoundingClientRect();
          const want = (parseFloat(s.style.width) / 100) * bar.width;
          return r.height > 0 && Math.abs(r.width - want) <= 1.5 && (want < 1 || r.width > 0);
        });
        const box = w.getBoundingClientRect();
        return { kind, bars: bars.length, segs: segs.length, visible: visible.length, width: box.width, height: box.height };
      });
    });
  } catch (err) {
    result = null;
    errors.push(`widgets did not render: ${err.message.split("\n")[0]}`);
  }

  const problems = [...errors];
  if (expected === 0) problems.push("no widget views in the page (was the notebook executed with widget state?)");
  if (result) {
    if (result.length !== expected) problems.push(`${result.length} rendered widgets for ${expected} widget views`);
    result.forEach((w, i) => {
      if (w.kind === "report" && w.bars !== 3) problems.push(`widget ${i}: ${w.bars} .vram-bar rows, expected 3`);
      if (w.kind === "estimate" && w.bars < 1) problems.push(`widget ${i}: an estimate without a .vram-bar`);
      if (w.width < 100 || w.height < 40) problems.push(`widget ${i}: box ${w.width}x${w.height} px`);
      if (w.visible !== w.segs) problems.push(`widget ${i}: ${w.segs - w.visible} of ${w.segs} segments not drawn to size`);
    });
    // Every measured cell that allocated something shows at least one coloured segment.
    if (result.length && result.every((w) => w.segs === 0)) problems.push("no .vram-seg segments anywhere");
  }

  const shot = join(outDir, name.replace(/\.html$/, ".png"));
  await page.screenshot({ path: shot, fullPage: true });
  const segs = result ? result.reduce((a, w) => a + w.visible, 0) : 0;
  const ms = Date.now() - started;
  if (problems.length) {
    failures += 1;
    console.log(`FAIL ${name}: ${problems.join("; ")} (screenshot ${shot})`);
  } else {
    const kinds = result.reduce((acc, w) => ({ ...acc, [w.kind]: (acc[w.kind] || 0) + 1 }), {});
    const counts = Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ");
    console.log(`ok   ${name}: ${expected} widgets rendered (${counts}), ${segs} bar segments drawn to size, ${ms} ms`);
  }
  await page.close();
}

console.log(`blocked non-local origins: ${[...blocked].sort().join(", ") || "none"}`);
await context.close();
rmSync(profile, { recursive: true, force: true });
process.exit(failures ? 1 : 0);
