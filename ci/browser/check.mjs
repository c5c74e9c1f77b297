// Open nbconvert HTML pages in headless Debian chromium with every non-local request blocked, and check that
// every vram_magic output reads there with no kernel and no widget state:
//   - a plain page: each report (.vram-report) is visible, its bar segments are drawn as wide as their bytes say,
//     and no output shows escaped markup;
//   - a page converted with --sanitize-html (name contains "sanitized"; every style attribute stripped, only a
//     few tags kept): each report's rows show their text bars (P G O A K letters, coloured by the page's ANSI
//     classes), and no output shows escaped markup either.
// Every per-rank view (%%vram --ranks, .vram-report.vram-ranks) is checked in both: a row per rank and moment
// (before, after, peak; the peak only past four ranks) and one for the estimate when there is one, named as such;
// plain, every row a bar on one shared scale and the estimate's mark on each rank's peak bar; sanitized, every row's
// text twin shown and the estimate written beside each peak; the error table with a row per rank, the imbalance,
// no live view.
// Saves a full-page screenshot of each page.
//
// usage: node check.mjs BASE_URL OUT_DIR PAGE.html [PAGE.html ...]
// env: CHROMIUM (default /usr/bin/chromium); VRAM_EXPECT_RANKS=N: every page must hold exactly N per-rank views

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [base, outDir, ...pages] = process.argv.slice(2);
const expectRanks = process.env.VRAM_EXPECT_RANKS === undefined ? null : Number(process.env.VRAM_EXPECT_RANKS);
if (!base || !outDir || pages.length === 0) {
  console.error("usage: node check.mjs BASE_URL OUT_DIR PAGE.html [PAGE.html ...]");
  process.exit(2);
}

const profile = mkdtempSync(join(tmpdir(), "vram-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1100, height: 900 },
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const local = new URL(base).host;
const blocked = new Set();
await context.route("**/*", (route) => {
  const u = new URL(route.request().url());
  if (u.host === local || ["data:", "blob:", "about:", "file:"].includes(u.protocol)) return route.continue();
  blocked.add(u.origin);
  return route.abort("blockedbyclient");
});

let failures = 0;
for (const name of pages) {
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (err) => errors.push(String(err)));
  const started = Date.now();
  await page.goto(new URL(name, base).href, { waitUntil: "load" });
  await page.waitForTimeout(300);
  const sanitized = name.includes("sanitized");
  const result = await page.evaluate(() => {
    const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
    const reports = [...document.querySelectorAll(".vram-report")];
    const outputs = [...document.querySelectorAll(".jp-OutputArea-output, .output_area")];
    // escaped markup shows as text like "<div" in an output
    // only vram_magic's outputs (pandas' own tables, say, are not ours to judge)
    const escaped = outputs.filter((o) => o.innerHTML.includes("vram-")).map((o) => o.innerText)
      .filter((t) => /<\/?(div|span|table|thead|tbody|tr|th|td|svg|style|p|br)\b/.test(t));
    const body = getComputedStyle(document.body).color;
    return {
      reports: reports.map((r) => {
        const bars = [...r.querySelectorAll(".vram-bar")];
        const segs = [...r.querySelectorAll(".vram-seg")].map((s) => {
          // segments are placed in the bar's padding box (inside its 1 px border)
          const bar = s.closest(".vram-bar");
          const inner = bar.clientWidth;
          const want = (Number(s.dataset.bytes) / Number(bar.dataset.scale)) * inner;
          const r = s.getBoundingClientRect();
          const end = r.right - (bar.getBoundingClientRect().left + bar.clientLeft);
          return { want, width: r.width, clipped: end >= inner - 1 };
        });
        const textbars = [...r.querySelectorAll(".vram-textbar")];
        const letters = textbars.filter(visible).map((t) => t.innerText.trim());
        const colours = new Set([...r.querySelectorAll(".vram-textbar span")].filter(visible)
          .map((s) => getComputedStyle(s).color).filter((c) => c !== body));
        const clean = (t) => t.replace(/\u00a0/g, " ").trim();
        const ranks = r.classList.contains("vram-ranks") ? {
          rows: [...r.querySelectorAll(".vram-bars .vram-row")].map((row) => {
            const bar = row.querySelector(".vram-bar");
            const tb = row.querySelector(".vram-textbar");
            return { name: clean(row.querySelector(".vram-name")?.textContent || ""), text: clean(row.innerText),
                     scale: bar ? bar.dataset.scale : undefined, barVisible: !!bar && visible(bar),
                     marks: [...row.querySelectorAll(".vram-mark")].filter(visible).length,
                     textbar: !!tb && visible(tb),
                     note: clean(row.querySelector(".vram-bar-note")?.innerText || "") };
          }),
          compareRows: [...r.querySelectorAll(".vram-ranks-compare .vram-compare-row")].filter(visible).length,
          hasCompare: !!r.querySelector(".vram-ranks-compare"),
          imbalance: [...r.querySelectorAll(".vram-imbalance")].filter(visible).map((e) => clean(e.innerText)),
          other: [...r.querySelectorAll(".vram-rank-other")].filter(visible).length,
          live: r.querySelectorAll(".vram-live").length,
        } : null;
        return { visible: visible(r), bars: bars.length, barsVisible: bars.filter(visible).length, segs,
                 textbars: textbars.length, letters, colours: colours.size, title: r.innerText.split("\n")[0], ranks };
      }),
      escaped,
    };
  });
  const problems = [...errors];
  if (!result.reports.length) problems.push("no vram_magic reports in the page");
  if (result.escaped.length) problems.push(`${result.escaped.length} output(s) show escaped markup: ${result.escaped[0].slice(0, 80)}`);
  let drawn = 0;
  const views = result.reports.filter((r) => r.ranks);
  if (expectRanks !== null && views.length !== expectRanks) problems.push(`${views.length} per-rank views, expected ${expectRanks}`);
  let rankRows = 0;
  views.forEach((r) => {
    const v = r.ranks;
    const say = (what) => problems.push(`per-rank view "${r.title.slice(0, 40)}": ${what}`);
    const rankRowsOf = v.rows.filter((row) => /^rank \d+ (before|after|peak)$/.test(row.name));
    const est = v.rows.filter((row) => row.name === "estimate");
    const ranks = [...new Set(rankRowsOf.map((row) => row.name.split(" ")[1]))];
    const moments = ranks.length <= 4 ? ["before", "after", "peak"] : ["peak"];
    const want = ranks.flatMap((n) => moments.map((m) => `rank ${n} ${m}`)).concat(v.hasCompare ? ["estimate"] : []);
    if (!ranks.length) say("no rank rows");
    if (v.rows.map((row) => row.name).join("|") !== want.join("|")) say(`rows ${v.rows.map((row) => row.name).join(", ")}`);
    if (est.length !== (v.hasCompare ? 1 : 0)) say(`${est.length} estimate rows`);
    const peaks = rankRowsOf.filter((row) => row.name.endsWith(" peak"));
    if (sanitized) {
      const hidden = v.rows.filter((row) => !row.textbar || !row.text.startsWith(row.name));
      if (hidden.length) say(`${hidden.length} rows without their name and text twin`);
      if (v.hasCompare && !peaks.every((row) => /estimate [\d.]+ (B|KiB|MiB|GiB|TiB) \([−+]\d+\.\d %\)/.test(row.text))) say("the estimate is not written beside each peak");
    } else {
      if (!v.rows.every((row) => row.barVisible)) say("a row without its bar");
      const scales = new Set(v.rows.map((row) => row.scale));
      if (scales.size !== 1 || !(Number([...scales][0]) > 0)) say(`bars on ${scales.size} scales (${[...scales].join(", ")})`);
      if (v.hasCompare && !peaks.every((row) => row.marks === 1)) say("the estimate is not marked on each rank's peak bar");
      if (v.rows.filter((row) => !row.name.endsWith(" peak")).some((row) => row.marks)) say("a mark on a bar that is not a rank's peak");
    }
    if (v.hasCompare && v.compareRows !== peaks.length) say(`${v.compareRows} rows in the error table for ${peaks.length} ranks`);
    if (v.imbalance.length !== 1 || !/^imbalance: /.test(v.imbalance[0])) say("no imbalance line");
    if (v.other > peaks.length) say(`${v.other} "other at the peak" lines for ${peaks.length} ranks`);
    if (v.live) say("a live view inside");
    rankRows += v.rows.length;
  });
  result.reports.forEach((r, i) => {
    if (!r.visible) problems.push(`report ${i} (${r.title}) is not visible`);
    if (sanitized) {
      const rows = r.textbars;
      const shown = r.letters.filter((t) => /^\|[PGOAK. x]{40}\|$/.test(t));
      if (rows && shown.length !== rows) problems.push(`report ${i} (${r.title}): ${shown.length} of ${rows} text bars show`);
      drawn += shown.length;
    } else {
      if (r.bars && r.barsVisible !== r.bars) problems.push(`report ${i}: ${r.bars - r.barsVisible} bars not drawn`);
      const off = r.segs.filter((s) => !s.clipped && Math.abs(s.width - s.want) > 1.5);
      if (off.length) problems.push(`report ${i} (${r.title}): ${off.length} segments not drawn to size`);
      drawn += r.segs.filter((s) => s.width >= 1).length;
    }
  });
  if (sanitized && !result.reports.some((r) => r.colours >= 2)) problems.push("text bars are not coloured by the page's classes");
  const shot = join(outDir, name.replace(/\.html$/, ".png"));
  await page.screenshot({ path: shot, fullPage: true });
  const ms = Date.now() - started;
  if (problems.length) {
    failures += 1;
    console.log(`FAIL ${name}: ${problems.join("; ")} (screenshot ${shot})`);
  } else {
    const what = sanitized ? "text bars shown" : "bar segments drawn to size";
    const perRank = views.length ? `, ${views.length} per-rank view(s) with ${rankRows} rows` : "";
    console.log(`ok   ${name}: ${result.reports.length} reports, ${drawn} ${what}${perRank}, no escaped markup, ${ms} ms`);
  }
  await page.close();
}

console.log(`blocked non-local origins: ${[...blocked].sort().join(", ") || "none"}`);
await context.close();
rmSync(profile, { recursive: true, force: true });
process.exit(failures ? 1 : 0);
