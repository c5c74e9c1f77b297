// The JupyterLab extension as users see it: a real JupyterLab 4 and Notebook 7, driven in Debian's headless chromium.
//
//   node lab_check.mjs SERVER_URL BIG_NOTEBOOK SMALL_NOTEBOOK OUT_DIR
//
// SERVER_URL: a Jupyter server without a token that serves both UIs, with vram_magic's server extension;
// BIG_NOTEBOOK holds a 256 MiB tensor and loads vram_magic (one measured cell), SMALL_NOTEBOOK holds next to nothing.
//
// In JupyterLab: run both notebooks; the status bar item #vram-magic-status shows the current notebook's kernel
// (its RSS here, "GPU x / y GiB" on a GPU) and follows the current tab; clicking it (and Enter on it) opens the
// panel #vram-magic-panel, whose sidebar tab has the same data-id; the panel lists both notebooks with a size each,
// the big one first and at least 256 MiB above the small one, with the measured cell's categories drawn in the
// report's palette; every control is a focusable button; nothing in the panel is cut off at 800 px or in a 220 px
// wide panel; text contrast >= 4.5:1 in the light and dark themes; shutting the small notebook's kernel down from
// the panel (through its confirmation dialog) removes it from the panel and from the server. In Notebook 7: the
// same panel, opened from the View menu, lists the big notebook. No console error comes from the extension.
// Every non-local request is blocked; nothing is downloaded.

import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";
import { installHelpers } from "./dom.mjs";

const [base, big, small, outDir] = process.argv.slice(2);
if (!base || !big || !small || !outDir) {
  console.error("usage: node lab_check.mjs SERVER_URL BIG_NOTEBOOK SMALL_NOTEBOOK OUT_DIR");
  process.exit(2);
}
mkdirSync(outDir, { recursive: true });

const MIN_CONTRAST = 4.5;
const MiB = 2 ** 20;
const HELD = 256 * MiB;
const SIZE = /(\d+(?:\.\d+)?)\s(B|KiB|MiB|GiB|TiB)/;
const UNITS = { B: 1, KiB: 2 ** 10, MiB: 2 ** 20, GiB: 2 ** 30, TiB: 2 ** 40 };
const bytesOf = (text) => {
  const m = String(text).replace(/\u00a0/g, " ").match(SIZE);
  return m ? Number(m[1]) * UNITS[m[2]] : NaN;
};

const failures = [];
const measures = {};
const check = (ok, what) => {
  if (!ok) failures.push(what);
  console.log(`${ok ? "ok  " : "FAIL"} ${what}`);
};
const started = Date.now();
const log = (msg) => console.log(`-- [${((Date.now() - started) / 1000).toFixed(1)} s] ${msg}`);

const profile = mkdtempSync(join(tmpdir(), "vram-lab-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1400, height: 900 },
  deviceScaleFactor: 2,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const local = new URL(base).host;
const blocked = new Set();
await context.route("**/*", (route) => {
  const u = new URL(route.request().url());
  if (u.host === local || ["data:", "blob:", "about:"].includes(u.protocol)) return route.continue();
  blocked.add(u.origin);
  return route.abort("blockedbyclient");
});
const page = await context.newPage();
const served = new Set();  // the extension's remoteEntry files the page loaded
page.on("request", (req) => {
  const m = req.url().match(/\/vram-magic\/static\/(remoteEntry\.[0-9a-f]+\.js)/);
  if (m) served.add(m[1]);
});
const consoleErrors = [];
page.on("console", (msg) => {
  if (msg.type() === "error") {
    consoleErrors.push({ text: msg.text(), url: msg.location()?.url || "", page: page.url().replace(base, "") });
  }
});
page.on("pageerror", (err) => consoleErrors.push({ text: String(err), url: "pageerror", page: page.url().replace(base, "") }));

const status = page.locator("#vram-magic-status");
const panel = page.locator("#vram-magic-panel");
const row = (path) => panel.locator(`li.vram-magic-kernel[data-path="${path}"]`);

async function menu(top, ...items) {
  await page.getByRole("menuitem", { name: top, exact: true }).first().click();
  for (const item of items) {
    const entry = page.locator(".lm-Menu .lm-Menu-item").filter({
      has: page.locator(".lm-Menu-itemLabel", { hasText: new RegExp(`^${item}$`) }) }).last();
    await entry.hover();
    await entry.click();
  }
}

async function runAll(path) {
  // the notebook's tab current and its kernel idle, then Run All; done when every cell has a count. A Run All
  // given while the kernel connection is still being set up can be dropped: given again if nothing started.
  const tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", { hasText: path });
  if (await tab.count()) await tab.first().click();
  const nbPanel = page.locator(".jp-NotebookPanel:visible");
  await nbPanel.locator(".jp-Cell").first().waitFor({ timeout: 90000 });
  const prompts = () => page.evaluate(() => {
    const nb = [...document.querySelectorAll(".jp-NotebookPanel")].find((p) => !p.classList.contains("lm-mod-hidden"));
    const texts = [...nb.querySelectorAll(".jp-CodeCell .jp-InputPrompt")].map((p) => p.textContent);
    return { all: texts.length, started: texts.filter((t) => /\[(\*|\d+)\]/.test(t)).length,
             done: texts.filter((t) => /\[\d+\]/.test(t)).length };
  });
  for (let attempt = 0; attempt < 3; attempt++) {
    await nbPanel.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first()
      .waitFor({ state: "attached", timeout: 90000 }).catch(() => {});
    await page.waitForTimeout(1000);
    await nbPanel.locator(".jp-Notebook").first().click();
    await menu("Run", "Run All Cells");
    const t0 = Date.now();
    while (Date.now() - t0 < 120000) {
      const state = await prompts();
      if (state.all && state.done === state.all) return true;
      if (state.started === 0 && Date.now() - t0 > 8000) break;  // nothing started: again
      await page.waitForTimeout(300);
    }
    measures[`${path}: Run All given again`] = attempt + 1;
  }
  return false;
}

async function activateTab(path) {
  await page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", { hasText: path }).first().click();
  await page.waitForTimeout(300);
}

async function statusFor(path, timeout = 20000) {
  // the item follows the current notebook; a new kernel shows at the next poll (or the one its change triggers)
  await activateTab(path);
  const t0 = Date.now();
  let text = "";
  while (Date.now() - t0 < timeout) {
    text = (await status.textContent()) || "";
    if (SIZE.test(text)) return text;
    await page.waitForTimeout(250);
  }
  return text;
}

async function inspectPanel() {
  return page.evaluate(() => {
    const V = window.__vram;
    const p = document.querySelector("#vram-magic-panel");
    const r = p.getBoundingClientRect();
    const cut = [...p.querySelectorAll("*")].filter((e) => V.visible(e)).map((e) => {
      const b = e.getBoundingClientRect();
      return { text: (e.textContent || e.className.baseVal || e.className).toString().trim().slice(0, 40), over: b.right - r.right };
    }).filter((x) => x.over > 1);
    return {
      width: r.width,
      scrollX: p.scrollWidth - p.clientWidth,
      contrast: V.textContrast(p),
      cut: cut.slice(0, 5),
      controls: [...p.querySelectorAll("button")].map((b) => ({ tag: b.tagName, tab: b.tabIndex, text: b.textContent })),
      rows: [...p.querySelectorAll("li.vram-magic-kernel")].map((li) => ({
        path: li.dataset.path, size: li.querySelector(".vram-magic-size")?.textContent || "",
        segs: [...li.querySelectorAll(".vram-magic-cell .vram-magic-seg")].map((s) => ({
          color: getComputedStyle(s).backgroundColor, width: s.getBoundingClientRect().width, title: s.title })),
      })),
    };
  });
}

async function shot(name, locator) {
  const path = join(outDir, `${name}.png`);
  if (locator) await locator.screenshot({ path });
  else await page.screenshot({ path });
}

try {
  // ------------------------------------------------------------------ JupyterLab
  log("JupyterLab: open both notebooks and run them");
  const ws = `${base}/lab/workspaces/ci-lab-${Date.now()}`;
  await page.goto(`${ws}/tree/${big}?reset`, { waitUntil: "domcontentloaded" });
  await page.locator(".jp-NotebookPanel .jp-Cell").first().waitFor({ timeout: 90000 });
  await page.evaluate(installHelpers);
  check(await runAll(big), `${big}: every cell ran`);
  await page.locator(".jp-DirListing-item", { hasText: small }).first().dblclick();
  await page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", { hasText: small }).first().waitFor({ timeout: 30000 });
  check(await runAll(small), `${small}: every cell ran`);

  const want = process.env.VRAM_REMOTE_ENTRY;
  check(!want || (served.size === 1 && served.has(want)), `the page runs the checkout's front end (${[...served].join(", ")}${want ? `; built: ${want}` : ""})`);

  log("JupyterLab: the status bar item");
  check(await status.count() === 1, "the status bar item #vram-magic-status is there");
  const smallText = await statusFor(small);
  const bigText = await statusFor(big);
  measures["status bar, small notebook"] = smallText;
  measures["status bar, big notebook"] = bigText;
  const shape = /^(GPU \d+\.\d \/ \d+\.\d GiB|RAM \d+(\.\d+)? (B|KiB|MiB|GiB))$/;
  check(shape.test(smallText) && shape.test(bigText), `status bar reads "${smallText}" / "${bigText}" (GPU x / y GiB or RAM size)`);
  if (/^RAM/.test(bigText)) {
    check(bytesOf(bigText) - bytesOf(smallText) >= 0.85 * HELD,
      `the current kernel's figure follows the tab: ${bigText} vs ${smallText} (the big one holds 256 MiB more)`);
  }
  const statusTitle = await status.getAttribute("title");
  check(/Click for every kernel/.test(statusTitle || ""), `the item says what it is and what a click does ("${statusTitle}")`);
  await shot("lab-status-bar", page.locator(".jp-StatusBar-Left, #jp-main-statusbar").first());

  log("JupyterLab: the panel");
  await status.click();
  await panel.waitFor({ state: "visible", timeout: 10000 });
  check(await page.locator('.jp-SideBar .lm-TabBar-tab[data-id="vram-magic-panel"]').count() === 1,
    "the panel's sidebar tab has data-id vram-magic-panel");
  await row(small).waitFor({ timeout: 20000 });
  await row(big).waitFor({ timeout: 20000 });
  await panel.locator(`li[data-path="${big}"] .vram-magic-cell .vram-magic-seg`).first().waitFor({ timeout: 20000 });
  await page.waitForTimeout(5500);  // one more poll: the history line has two samples
  let p = await inspectPanel();
  measures["lab light: panel"] = p;
  const rb = p.rows.find((r) => r.path === big);
  const rs = p.rows.find((r) => r.path === small);
  check(!!rb && !!rs && SIZE.test(rb.size) && SIZE.test(rs.size), `the panel lists both notebooks with a size each (${rb?.size}, ${rs?.size})`);
  check(p.rows[0]?.path === big, `the kernel holding more comes first (${p.rows.map((r) => r.path).join(", ")})`);
  if (rb && rs && /^RAM/.test(rb.size)) {
    check(bytesOf(rb.size) - bytesOf(rs.size) >= 0.85 * HELD, `${big} reads >= 0.85 x 256 MiB more (${rb.size} vs ${rs.size})`);
  }
  const params = rb?.segs.find((s) => /parameters/.test(s.title));
  check(!!params && params.color === "rgb(120, 94, 240)" && params.width > 1,
    `the measured cell's parameters drawn in the report's colour #785EF0 (${params?.color}, ${params?.width?.toFixed(1)} px)`);
  check(await panel.locator(`li[data-path="${big}"] .vram-magic-spark polyline`).count() === 1, "a history line per kernel");
  check(p.controls.length >= 7 && p.controls.every((c) => c.tag === "BUTTON" && c.tab >= 0),
    `every control in the panel is a focusable button (${p.controls.length})`);
  check(p.contrast.ratio >= MIN_CONTRAST, `lab light: panel text contrast ≥ ${MIN_CONTRAST}:1 (worst ${p.contrast.ratio.toFixed(2)}:1, "${p.contrast.text}")`);
  const sc = await status.evaluate((el) => window.__vram.textContrast(el.parentElement));
  check(sc.ratio >= MIN_CONTRAST, `lab light: status bar text contrast ≥ ${MIN_CONTRAST}:1 (${sc.ratio.toFixed(2)}:1)`);
  check(p.scrollX <= 1 && p.cut.length === 0, `lab light: nothing in the panel cut off at ${p.width.toFixed(0)} px (${JSON.stringify(p.cut)})`);
  await shot("lab-panel-light", panel);
  await shot("lab-light", null);

  log("JupyterLab: keyboard");
  await page.locator(".jp-SideBar .lm-TabBar-tab[data-id='vram-magic-panel']").click();  // closes the panel
  await panel.waitFor({ state: "hidden", timeout: 5000 });
  await status.focus();
  await page.keyboard.press("Enter");
  await panel.waitFor({ state: "visible", timeout: 5000 });
  check(true, "Enter on the focused status bar item opens the panel");
  await panel.locator("button").first().focus();
  await page.keyboard.press("Tab");
  const next = await page.evaluate(() => document.activeElement?.closest("#vram-magic-panel") !== null);
  check(next, "Tab moves from one panel control to the next");

  log("JupyterLab: narrow");
  await page.setViewportSize({ width: 800, height: 900 });
  await page.waitForTimeout(800);
  p = await inspectPanel();
  check(p.scrollX <= 1 && p.cut.length === 0, `lab 800 px: nothing in the panel cut off (${p.width.toFixed(0)} px wide; ${JSON.stringify(p.cut)})`);
  // JupyterLab keeps a side bar at least 250 px wide; the panel itself must also read at 200 px (Notebook 7, zoom)
  await panel.evaluate((el) => { el.style.maxWidth = "200px"; });
  await page.waitForTimeout(500);
  p = await inspectPanel();
  measures["lab 200 px panel"] = { width: p.width, scrollX: p.scrollX, cut: p.cut };
  check(p.scrollX <= 1 && p.cut.length === 0, `a 200 px panel: nothing cut off (${JSON.stringify(p.cut)})`);
  await shot("lab-panel-200px", panel);
  await panel.evaluate((el) => { el.style.maxWidth = ""; });
  await page.setViewportSize({ width: 1400, height: 900 });
  await page.waitForTimeout(800);

  // The GPU layout: the server's own answer with what NVML adds on a GPU machine (one device, the big kernel's
  // process on it), served to the page in place of the real one for one poll; the figures are worked out here.
  log("JupyterLab: the layout of a GPU machine's answer");
  const GiB = 2 ** 30;
  const isRoute = (url) => url.pathname.endsWith("/vram-magic/kernels");  // Lab adds a cache-busting query
  await page.route(isRoute, async (route) => {
    const real = await (await route.fetch()).json();
    const device = { index: 0, name: "NVIDIA H200", uuid: "GPU-0", total: 150_000_000_000, used: 5 * GiB,
                     free: 150_000_000_000 - 5 * GiB, mig: false, processes: 2, kernels: 3.2 * GiB, other: 1.8 * GiB };
    for (const k of real.kernels) {
      if (k.path === big) k.gpu = [{ index: 0, device: null, name: device.name, used: 3.2 * GiB, total: device.total, source: "nvml" }];
    }
    await route.fulfill({ json: { ...real, devices: [device], notes: [] } });
  });
  await panel.locator('button[data-action="refresh"]').click();
  await panel.locator(".vram-magic-device").waitFor({ timeout: 10000 });
  await page.waitForTimeout(500);
  const gpuStatus = await status.textContent();
  check(gpuStatus === "GPU 3.2 / 139.7 GiB", `GPU layout: the status bar reads "${gpuStatus}" (3.2 GiB of a 150e9 B device: 139.7 GiB)`);
  const gp = await inspectPanel();
  const gbig = gp.rows.find((r) => r.path === big);
  check(gp.rows[0]?.path === big && gbig?.size === "GPU 3.20 GiB", `GPU layout: ${big} first, reading ${gbig?.size}`);
  const dev = await panel.locator(".vram-magic-device").innerText();
  check(/GPU 0 · NVIDIA H200/.test(dev) && /5\.0 \/ 139\.7 GiB/.test(dev) && /kernels 3\.20 GiB/.test(dev) && /other processes 1\.80 GiB/.test(dev),
    `GPU layout: the device row names the device, used of total, the kernels' and the other processes' share ("${dev.replace(/\s+/g, " ")}")`);
  const segs = await panel.locator(".vram-magic-device .vram-magic-seg").evaluateAll((els) => els.map((e) => e.getBoundingClientRect().width));
  const barWidth = await panel.locator(".vram-magic-device .vram-magic-bar").evaluate((e) => e.clientWidth);
  check(segs.length === 2 && Math.abs(segs[0] - (3.2 * GiB / 150e9) * barWidth) <= 1,
    `GPU layout: the kernels' share drawn to scale (${segs[0]?.toFixed(1)} px of ${barWidth} px)`);
  check(gp.contrast.ratio >= MIN_CONTRAST && gp.cut.length === 0, `GPU layout: contrast ${gp.contrast.ratio.toFixed(2)}:1, nothing cut off`);
  await shot("lab-panel-gpu-layout", panel);
  await page.unroute(isRoute);
  await panel.locator('button[data-action="refresh"]').click();
  await panel.locator(".vram-magic-device").waitFor({ state: "detached", timeout: 10000 });

  log("JupyterLab: dark theme");
  await menu("Settings", "Theme", "JupyterLab Dark");
  await page.waitForFunction(() => document.body.dataset.jpThemeLight === "false", null, { timeout: 20000 });
  await page.waitForTimeout(1500);
  p = await inspectPanel();
  measures["lab dark: contrast"] = p.contrast;
  check(p.contrast.ratio >= MIN_CONTRAST, `lab dark: panel text contrast ≥ ${MIN_CONTRAST}:1 (worst ${p.contrast.ratio.toFixed(2)}:1, "${p.contrast.text}")`);
  const track = await panel.locator(".vram-magic-bar").first().evaluate((el) => {
    const c = window.__vram.over(window.__vram.parse(getComputedStyle(el).backgroundColor), window.__vram.background(el.parentElement));
    return window.__vram.lum(c);
  });
  check(track < 0.05, `lab dark: an empty bar track is not bright (luminance ${track.toFixed(3)})`);
  const scd = await status.evaluate((el) => window.__vram.textContrast(el.parentElement));
  check(scd.ratio >= MIN_CONTRAST, `lab dark: status bar text contrast ≥ ${MIN_CONTRAST}:1 (${scd.ratio.toFixed(2)}:1)`);
  await shot("lab-panel-dark", panel);
  await shot("lab-dark", null);
  await menu("Settings", "Theme", "JupyterLab Light");
  await page.waitForFunction(() => document.body.dataset.jpThemeLight === "true", null, { timeout: 20000 });

  log("JupyterLab: shut a kernel down from the panel");
  await row(small).locator('button[data-action="shutdown"]').click();
  const dialog = page.locator(".jp-Dialog");
  await dialog.waitFor({ timeout: 10000 });
  const dialogText = await dialog.innerText();
  check(/Shut down the kernel of/.test(dialogText) && SIZE.test(dialogText), `a confirmation names the notebook and what it frees ("${dialogText.replace(/\s+/g, " ").slice(0, 120)}")`);
  await shot("lab-shutdown-dialog", dialog.locator(".jp-Dialog-content"));
  await dialog.locator(".jp-Dialog-button.jp-mod-accept").click();
  const gone = await row(small).waitFor({ state: "detached", timeout: 20000 }).then(() => true, () => false);
  check(gone, `${small} left the panel after its kernel was shut down`);
  const kernels = await page.evaluate(async (u) => (await (await fetch(`${u}/api/kernels`)).json()).length, base);
  check(kernels === 1, `the server runs one kernel left (${kernels})`);
  check(await row(big).count() === 1, `${big} is still listed`);

  // ------------------------------------------------------------------ Notebook 7
  log("Notebook 7: the same panel");
  await page.goto(`${base}/notebooks/${big}`, { waitUntil: "domcontentloaded" });
  await page.locator(".jp-Notebook .jp-Cell").first().waitFor({ timeout: 90000 });
  await page.evaluate(installHelpers);
  await menu("View", "Kernel Memory");
  await panel.waitFor({ state: "visible", timeout: 10000 });
  await row(big).waitFor({ timeout: 20000 });
  p = await inspectPanel();
  measures["notebook 7: panel"] = { width: p.width, rows: p.rows.map((r) => [r.path, r.size]), contrast: p.contrast };
  check(p.rows.length === 1 && p.rows[0].path === big && SIZE.test(p.rows[0].size), `Notebook 7: the panel lists ${big} (${p.rows[0]?.size})`);
  check(p.contrast.ratio >= MIN_CONTRAST, `Notebook 7: panel text contrast ≥ ${MIN_CONTRAST}:1 (worst ${p.contrast.ratio.toFixed(2)}:1)`);
  check(p.scrollX <= 1 && p.cut.length === 0, `Notebook 7: nothing in the panel cut off (${JSON.stringify(p.cut)})`);
  await shot("notebook7-panel", panel);
  await shot("notebook7", null);
} catch (err) {
  failures.push(`the run stopped: ${err.message.split("\n")[0]}`);
  console.log(String(err.stack || err));
  await page.screenshot({ path: join(outDir, "failure.png") }).catch(() => {});
}

const ours = consoleErrors.filter((e) => /vram[-_]magic/.test(e.text + e.url));
check(ours.length === 0, `no console error from the extension (${ours.map((e) => e.text).join(" | ").slice(0, 300) || "none"})`);
measures["console errors (all)"] = consoleErrors.map((e) => `${e.page}: ${e.text.slice(0, 200)} (${e.url})`);
measures["blocked non-local origins"] = [...blocked].sort();
measures["seconds"] = (Date.now() - started) / 1000;
writeFileSync(join(outDir, "measures.json"), JSON.stringify(measures, null, 1));
console.log(JSON.stringify({ ...measures, "lab light: panel": "(in measures.json)" }, null, 1));
await context.close();
rmSync(profile, { recursive: true, force: true });
console.log(failures.length ? `${failures.length} check(s) failed` : "all checks passed");
process.exit(failures.length ? 1 : 0);
