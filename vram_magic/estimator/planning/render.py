"""Text and HTML of a plan: the rows fastest first, each with what it needs, its step time and where the time goes;
the best row's code; the assumptions the times rest on (pure functions of the result)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ...core.units import format_bytes
from ...render.bars import Cell, grid_html, values_html
from ...render.text import table
from ...render.theme import BAD, GOOD, MUTED, NUM, ROOT, SMALL

if TYPE_CHECKING:
    from .result import Plan, PlanCheck, PlanRow

#: the parts of a step's time, in the order the columns show them
PARTS = ("compute", "memory", "recompute", "optimizer", "transfers", "collectives", "bubble")


def seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"


def rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.1f}"


def heading(p: Plan) -> str:
    where = f"{p.gpus} × {p.gpu}" if p.gpu else p.device
    bounded = f", {p.bounded} bounded untraced" if p.bounded else ""
    mine = f" · your step {p.step}() as written" if p.step else ""
    return (f"%vram_plan {p.model}{mine} · {where} · global batch {p.global_batch} · {len(p.scored)} combinations "
            f"scored{bounded} ({p.traced} fake runs) in {p.wall_time:.1f} s")


def _parts(r: PlanRow) -> str:
    total = r.step_time or 1.0
    shown = [(k, r.time.get(k, 0.0)) for k in PARTS if r.time.get(k, 0.0) > 0.005 * total]
    return ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in shown)


def _footer(p: Plan) -> list[str]:
    lines = []
    best = p.best
    if best is not None:
        mine = f"step={p.step}, " if p.step else ""
        lines.append(f"best: {best.name} — estimate(model, inputs, {mine}**plan.best.options) gives its memory")
        lines += [f"  {line}" for code in best.code for line in code.split("\n")]
    if p.calibration is not None:
        lines.append(f"times calibrated ×{p.calibration[0]:.2f} on {p.calibration[1]}")
    else:
        lines.append("times predicted, not calibrated: %%vram --plan plan[:ROW] on a cell running one step measures "
                     "it, and plan.calibrate(report) scales every time by it")
    lines += [f"assumed: {a}" for a in p.assumptions]
    lines += [f"note: {n}" for n in p.notes]
    return lines


#: what a partial row says under it (a plan always has a capacity: a row whose fit is not known stopped early)
PARTIAL = ("PARTIAL: the step stopped at an op fake tensors cannot run; needed is a lower bound and whether it fits is "
           "not known (estimate(model, inputs, **row.options) names the op)")


def _partial(r: PlanRow) -> bool:
    return r.fits is None


def _needed(r: PlanRow) -> str:
    return ("≥ " if _partial(r) else "") + format_bytes(r.needed)


def plan_text(p: Plan) -> str:
    out = [heading(p)]
    w = 7 if any(_partial(r) for r in p.rows) else 4
    out.append(f"   {'plan':<52}{'needed':>11}  {'fits':<{w}}  {'step':>9}  {p.unit:>10}  where the time goes")
    for i, r in enumerate(p.rows):
        fits = "yes" if r.fits else "partial" if _partial(r) else "no"
        out.append(f"{i:>2} {r.name[:52]:<52}{_needed(r):>11}  {fits:<{w}}  {seconds(r.step_time):>9}  "
                   f"{rate(r.throughput):>10}  {_parts(r)}")
        extra = [PARTIAL] if _partial(r) else []
        extra += [f"numerics: {'; '.join(r.numerics)}"] if r.numerics else []
        extra += [f"costs: {t}" for t in r.tradeoffs]
        out += [f"     {line}" for line in extra]
    if not p.rows:
        out.append("   nothing was estimated")
    out += [f"  {line}" for line in _footer(p)]
    return "\n".join(out)


def plan_html(p: Plan) -> str:
    num = f"{NUM};padding-right:0.9em"
    name_w = max([len(r.name) for r in p.rows] + [4])
    heads = [("#", "right", 2), ("plan", "left", name_w), ("needed", "right", 10), ("fits", "left", 6),
             ("step", "right", 9), (p.unit, "right", 10), ("where the time goes", "left", 0)]
    lines = [("vram-plan-head", [Cell(h, h, w, a, "font-weight:bold;white-space:nowrap;padding-right:0.9em")
                                 for h, a, w in heads])]
    for i, r in enumerate(p.rows):
        fits = (Cell(f'<span style="{GOOD};font-weight:bold">✔ fits</span>', "✔ fits", 6) if r.fits else
                Cell(f'<span class="vram-partial" style="{BAD};font-weight:bold">⚠ partial</span>', "⚠ partial", 9)
                if _partial(r) else Cell(f'<span style="{BAD};font-weight:bold">✘ no</span>', "✘ no", 6))
        notes = "; ".join([*([PARTIAL] if _partial(r) else []), *r.numerics, *r.tradeoffs])
        lines.append(("vram-plan-row", [
            Cell(str(i), str(i), 2, "right", num),
            Cell(html.escape(r.name) + (f'<div style="{MUTED}">{html.escape(notes)}</div>' if notes else ""), r.name,
                 name_w, style="white-space:normal;min-width:16em;padding-right:0.9em"),
            Cell(_needed(r), _needed(r), 10, "right", num), fits,
            Cell(seconds(r.step_time), seconds(r.step_time), 9, "right", num),
            Cell(rate(r.throughput), rate(r.throughput), 10, "right", num),
            Cell(html.escape(_parts(r)), _parts(r), style=f"white-space:normal;min-width:10em;{MUTED}")]))
    parts = [f'<div class="vram-report vram-plan" style="{ROOT}">',
             f'<div class="vram-title" style="font-weight:bold;margin-bottom:2px">{html.escape(heading(p))}</div>',
             f'<div class="vram-scroll" style="overflow-x:auto;max-width:100%">'
             f'{grid_html(lines, cls="vram-plan-table", style=SMALL)}</div>']
    for line in _footer(p):
        style = "" if line.startswith("best") else MUTED
        if line.startswith("  "):
            parts.append(f'<div style="{SMALL}"><code>{html.escape(line.strip())}</code></div>')
        else:
            parts.append(f'<div class="vram-note" style="{SMALL};{style}">{html.escape(line)}</div>')
    parts.append("</div>")
    return "".join(parts)


def _check_lines(c: PlanCheck) -> list[str]:
    r = c.row
    lines = [f"time: predicted {seconds(r.step_time)}{' (calibrated)' if c.calibrated else ''}, measured "
             f"{seconds(c.measured_time)} (×{c.ratio:.2f})"]
    if not c.calibrated:
        lines.append("plan.calibrate(report) scales every row's time by the measured step")
    if c.device.split(":")[0] != c.planned_device:
        lines.append(f"the cell ran on {c.device}, the plan is for {c.planned_device}: the figures compare "
                     "different devices")
    lines.append("the cell is taken to run one optimizer step of the row (its time includes whatever else it ran)")
    return lines


def check_text(c: PlanCheck) -> str:
    out = [f"%%vram --plan row {c.index}: {c.row.name}",
           table([("predicted", c.row.peak), ("measured", c.measured)])]
    out += [f"  {line}" for line in _check_lines(c)]
    return "\n".join(out)


def check_html(c: PlanCheck) -> str:
    parts = [f'<div class="vram-report vram-plan-check" style="{ROOT}">',
             f'<div class="vram-title" style="font-weight:bold">%%vram --plan row {c.index}: '
             f"{html.escape(c.row.name)}</div>", values_html([("predicted", c.row.peak), ("measured", c.measured)])]
    parts += [f'<div style="{SMALL}">{html.escape(line)}</div>' for line in _check_lines(c)]
    parts.append("</div>")
    return "".join(parts)
