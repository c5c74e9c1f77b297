// Screenshot of a %%vram widget in JupyterLab, for the README (docs/img/widget.png).
//
// usage: node lab_screenshot.mjs LAB_URL NOTEBOOK OUT.png [WIDGET_INDEX]
//   LAB_URL   a running JupyterLab without a token, e.g. http://127.0.0.1:8899
//   NOTEBOOK  its path relative to the server's root, e.g. 01_what_fills_gpu_memory.ipynb
//   WIDGET_INDEX  which %%vram output to capture (default 0)
// The notebook is run with "Run All Cells" in a live kernel, so the widget is the one JupyterLab renders.
// See docs/notebooks.md for the commands around it. env: CHROMIUM (default /usr/bin/chromium)

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [lab, notebook, out, which = "0"] = process.argv.slice(2);
if (!lab || !notebook || !out) {
  console.error("usage: node lab_screenshot.mjs LAB_URL NOTEBOOK OUT.png [WIDGET_INDEX]");
  process.exit(2);
}

const profile = mkdtempSync(join(tmpdir(), "vram-lab-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1280, height: 1000 },
  deviceScaleFactor: 2,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const local = new URL(lab).host;
await context.route("**/*", (route) => {
  const u = new URL(route.request().url());
  return u.host === local || u.protocol === "data:" || u.protocol === "blob:" ? route.continue() : route.abort();
});

const page = await context.newPage();
await page.goto(`${lab}/lab/tree/${notebook}`, { waitUntil: "domcontentloaded" });
await page.locator(".jp-Notebook .jp-Cell").first().waitFor({ timeout: 60000 });
// Wait for the kernel, then run every cell.
await page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").waitFor({ timeout: 60000 }).catch(() => {});
await page.locator(".jp-Notebook").click();
await page.getByRole("menuitem", { name: "Run", exact: true }).click();
await page.getByText("Run All Cells", { exact: true }).click();

const index = Number(which);
const widget = page.locator(".jp-Cell .vram-widget").nth(index);
await widget.waitFor({ timeout: 120000 });
await page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").waitFor({ timeout: 120000 }).catch(() => {});
const cell = page.locator(".jp-Cell", { has: page.locator(".vram-widget") }).nth(index);
await cell.scrollIntoViewIfNeeded();
await page.waitForTimeout(500);
await cell.screenshot({ path: out });
console.log(`wrote ${out}`);
await context.close();
rmSync(profile, { recursive: true, force: true });
