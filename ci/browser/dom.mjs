// Measurements taken inside the page (passed to page.evaluate): colours, contrast, line breaks, geometry.
// Plain functions with no closure over Node state, so Playwright can serialise them.

// Everything the checks need, installed once per page as window.__vram.
export function installHelpers() {
  if (window.__vram) return;
  const parse = (str) => {
    // "rgb(1, 2, 3)", "rgba(1, 2, 3, 0.5)", "color(srgb 0.1 0.2 0.3 / 0.5)", "transparent"
    if (!str || str === "transparent") return [0, 0, 0, 0];
    let m = str.match(/^rgba?\(([^)]+)\)$/);
    if (m) {
      const p = m[1].split(/[,\s/]+/).filter(Boolean).map(Number);
      return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
    }
    m = str.match(/^color\(srgb\s+([^)]+)\)$/);
    if (m) {
      const p = m[1].split(/[\s/]+/).filter(Boolean).map(Number);
      return [p[0] * 255, p[1] * 255, p[2] * 255, p.length > 3 ? p[3] : 1];
    }
    throw new Error(`cannot read colour ${str}`);
  };
  const over = (top, bottom) => {
    // top composited over an opaque bottom
    const a = top[3];
    return [0, 1, 2].map((i) => top[i] * a + bottom[i] * (1 - a)).concat([1]);
  };
  const lum = (c) => {
    const ch = c.slice(0, 3).map((v) => {
      const s = v / 255;
      return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2];
  };
  const contrast = (a, b) => {
    const la = lum(a), lb = lum(b);
    return (Math.max(la, lb) + 0.05) / (Math.min(la, lb) + 0.05);
  };
  // The colour behind an element: its own and its ancestors' backgrounds, composited from the page down.
  const background = (el) => {
    const chain = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c[3] > 0) chain.push(c);
      if (c[3] >= 1) break;
    }
    let acc = [255, 255, 255, 1];
    if (chain.length && chain[chain.length - 1][3] >= 1) acc = chain.pop();
    while (chain.length) acc = over(chain.pop(), acc);
    return acc;
  };
  const visible = (el) => {
    if (el.closest("[hidden]")) return false;
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== "hidden";
  };
  const textElements = (root) => {
    const out = [];
    for (const el of root.querySelectorAll("*")) {
      if (![...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim())) continue;
      if (visible(el)) out.push(el);
    }
    return out;
  };
  // Worst text contrast inside root: text colour (with its alpha) over the background behind it.
  const textContrast = (root) => {
    let worst = { ratio: Infinity };
    let count = 0;
    for (const el of textElements(root)) {
      const bg = background(el);
      const fg = over(parse(getComputedStyle(el).color), bg);
      const ratio = contrast(fg, bg);
      count += 1;
      if (ratio < worst.ratio) {
        worst = { ratio, text: el.textContent.trim().slice(0, 40), fg: fg.map(Math.round), bg: bg.map(Math.round) };
      }
    }
    return { ...worst, count };
  };
  // Words split over two lines: a word whose range has client rects on two different lines.
  const brokenWords = (root) => {
    const broken = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    let node;
    while ((node = walker.nextNode())) {
      if (!node.parentElement || !visible(node.parentElement)) continue;
      const text = node.textContent;
      // a line may end after a hyphen ("reduce-|scatter"), never inside a word
      const re = /[^\s-]+-?/g;
      let m;
      while ((m = re.exec(text))) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
        if (tops.size > 1) broken.push(m[0]);
      }
    }
    return broken;
  };
  // Numbers with a unit that wrapped ("56.7 / MiB").
  const wrappedSizes = (root) => {
    const out = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    let node;
    const re = /[−+±]?\d[\d.,]*[\s\u00a0](B|KiB|MiB|GiB|TiB)\b/g;
    while ((node = walker.nextNode())) {
      if (!node.parentElement || !visible(node.parentElement)) continue;
      let m;
      while ((m = re.exec(node.textContent))) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
        if (tops.size > 1) out.push(m[0]);
      }
    }
    return out;
  };
  // Line height against font size over the report's text.
  const lineHeights = (root) => {
    let worst = 0;
    let where = "";
    for (const el of textElements(root)) {
      const cs = getComputedStyle(el);
      const lh = cs.lineHeight === "normal" ? 1.2 * parseFloat(cs.fontSize) : parseFloat(cs.lineHeight);
      const ratio = lh / parseFloat(cs.fontSize);
      if (ratio > worst) { worst = ratio; where = el.textContent.trim().slice(0, 30); }
    }
    return { worst, where };
  };
  window.__vram = { parse, over, lum, contrast, background, visible, textContrast, brokenWords, wrappedSizes, lineHeights };
}

// Everything about the reports of one page, for assertions in Node.
export function inspectReports() {
  const V = window.__vram;
  const reports = [...document.querySelectorAll(".vram-report")].filter((r) => V.visible(r));
  return reports.map((r) => {
    const kind = r.classList.contains("vram-live") ? "live" : r.classList.contains("vram-estimate") ? "estimate"
      : r.classList.contains("vram-watch") ? "watch" : r.classList.contains("vram-now") ? "now"
      : r.classList.contains("vram-ranks") ? "ranks" : "report";
    const rect = r.getBoundingClientRect();
    const area = r.closest(".jp-OutputArea-output") || r.parentElement;
    const areaRect = area.getBoundingClientRect();
    const bars = [...r.querySelectorAll(".vram-bar")].map((bar) => {
      // positions inside the bar's padding box (its border is 1 px): where the segments' percentages apply
      const outer = bar.getBoundingClientRect();
      const b = { left: outer.left + bar.clientLeft, width: bar.clientWidth };
      const scale = Number(bar.dataset.scale);
      const segs = [...bar.querySelectorAll(".vram-seg, .vram-extra")].map((s) => {
        const sr = s.getBoundingClientRect();
        return { cls: s.className, bytes: Number(s.dataset.bytes), left: sr.left - b.left, right: sr.right - b.left,
                 width: sr.width, color: getComputedStyle(s).backgroundColor };
      });
      const limit = bar.querySelector(".vram-limit");
      const lr = limit ? limit.getBoundingClientRect() : null;
      const track = V.over(V.parse(getComputedStyle(bar).backgroundColor), V.background(bar.parentElement));
      // the row's name (per-rank view: "rank 0 peak") and its thin markers (the estimate beside a rank's peak)
      const nameEl = bar.closest(".vram-row")?.querySelector(".vram-name");
      const marks = [...bar.querySelectorAll(".vram-mark")].map((m) => ({
        x: m.getBoundingClientRect().left - b.left, title: m.title.replace(/\u00a0/g, " "), visible: V.visible(m) }));
      return { width: b.width, scale, segs, limitX: lr ? lr.left - b.left : null, trackLum: V.lum(track),
               track: track.map(Math.round), name: nameEl ? nameEl.textContent.replace(/\u00a0/g, " ").trim() : "",
               marks };
    });
    const limitLabel = r.querySelector(".vram-limit-label");
    const llr = limitLabel ? limitLabel.getBoundingClientRect() : null;
    const firstBar = r.querySelector(".vram-bar");
    const fbr = firstBar ? firstBar.getBoundingClientRect() : null;
    const scrolls = [...r.querySelectorAll(".vram-scroll")].map((s) => ({
      overflowX: getComputedStyle(s).overflowX, scrollWidth: s.scrollWidth, clientWidth: s.clientWidth }));
    return {
      kind,
      title: (r.querySelector(".vram-title") || r).textContent.replace(/\u00a0/g, " ").trim().slice(0, 120),
      text: r.innerText.replace(/\u00a0/g, " "),
      left: rect.left, right: rect.right, width: rect.width, areaRight: areaRect.right, areaLeft: areaRect.left,
      scrollWidth: r.scrollWidth, clientWidth: r.clientWidth,
      bars,
      limitLabel: llr ? { text: limitLabel.textContent.replace(/\u00a0/g, " "), left: llr.left - fbr.left, right: llr.right - fbr.left,
                          barWidth: fbr.width, visible: V.visible(limitLabel) } : null,
      contrast: V.textContrast(r),
      lineHeight: V.lineHeights(r),
      broken: V.brokenWords(r),
      wrapped: V.wrappedSizes(r),
      scrolls,
      ranks: r.classList.contains("vram-ranks") ? (() => {
        const texts = (sel) => [...r.querySelectorAll(sel)].map((e) => e.innerText.replace(/\u00a0/g, " ").trim());
        return {
          compareRows: [...r.querySelectorAll(".vram-ranks-compare .vram-compare-row")]
            .map((row) => [...row.children].map((c) => c.textContent.replace(/\u00a0/g, " ").trim())),
          compareHead: texts(".vram-ranks-compare .vram-head").join(" "),
          imbalance: texts(".vram-imbalance"),
          other: texts(".vram-rank-other"),
          errors: texts(".vram-rank-error"),
          notes: texts(".vram-bar-note"),
          textbars: r.querySelectorAll(".vram-textbar").length,
          textbarsHidden: [...r.querySelectorAll(".vram-textbar")].filter((t) => !V.visible(t)).length,
          live: r.querySelectorAll(".vram-live").length,
        };
      })() : null,
      // visible elements that reach past the output area's right edge outside a sideways-scrolling box: cut off
      clipped: [...r.querySelectorAll("*")].filter((e) => !e.closest(".vram-scroll") && V.visible(e)
        && e.getBoundingClientRect().right > areaRect.right + 1).map((e) => ({
        where: [...e.classList].find((c) => c.startsWith("vram-"))
          || [...e.parentElement.closest("[class*='vram-']").classList].find((c) => c.startsWith("vram-")),
        inside: [...r.querySelectorAll("[class*='vram-']")].filter((a) => a.contains(e) && a !== e && a !== r)
          .map((a) => [...a.classList].find((c) => c.startsWith("vram-"))),
        past: e.getBoundingClientRect().right - areaRect.right, pastReport: e.getBoundingClientRect().right - rect.right,
        text: e.textContent.replace(/\u00a0/g, " ").trim().slice(0, 30) })),
      // axis labels drawn over one another (px of the widest overlap of two labels' text)
      axisOverlap: [...r.querySelectorAll(".vram-axis")].map((axis) => {
        const rs = [...axis.querySelectorAll(".vram-tick, .vram-limit-label")].filter(V.visible).map((e) => {
          const range = document.createRange();
          range.selectNodeContents(e);
          return range.getBoundingClientRect();
        });
        // the widest horizontal intersection of two labels' text
        return Math.max(0, ...rs.flatMap((a, i) => rs.slice(i + 1).map((q) => Math.min(a.right, q.right) - Math.max(a.left, q.left))));
      }).reduce((a, b) => Math.max(a, b), 0),
      codeInAdvice: r.querySelectorAll(".vram-advice code").length,
      adviceText: [...r.querySelectorAll(".vram-advice")].map((a) => a.innerText).join("\n"),
      fitMarks: [...r.querySelectorAll(".vram-fits, .vram-fails")].map((m) => {
        const bg = V.background(m);
        const fg = V.over(V.parse(getComputedStyle(m).color), bg);
        return { cls: m.className, color: fg.map(Math.round), contrast: V.contrast(fg, bg),
                 fontSize: parseFloat(getComputedStyle(m).fontSize) };
      }),
      whatIf: (() => {
        const t = r.querySelector(".vram-what-if");
        if (!t) return null;
        const rows = [...t.querySelectorAll(".vram-what-if-head, .vram-what-if-row")];
        const head = [...rows[0].children].map((c) => c.textContent.trim());
        const body = rows.slice(1).map((tr) => [...tr.children].map((c) => ({
          text: c.textContent.trim(), align: getComputedStyle(c).textAlign, right: c.getBoundingClientRect().right,
          textRight: (() => { const rg = document.createRange(); rg.selectNodeContents(c);
                              const rs = [...rg.getClientRects()]; return rs.length ? rs[rs.length - 1].right : 0; })(),
        })));
        return { head, body };
      })(),
    };
  });
}
