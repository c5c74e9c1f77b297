"""Plain-text rendering: terminal IPython, ``text/plain`` of saved notebooks, ``print(report)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...core.breakdown import CATEGORIES, LABELS, shown_categories
from ...core.events import format_frame
from ...core.units import format_bytes
from ...render.text import bar, experts_line, legend, table

if TYPE_CHECKING:
    from ..live_status import LiveStatus
    from ..report import CellReport

def title(report: CellReport) -> str:
    cell = f"cell {report.cell}" if report.cell is not None else "block"
    cap = ""
    if report.capacity:
        cap = f" · {'budget' if report.budget else 'capacity'} {format_bytes(report.capacity)}"
    backend = getattr(report, "backend", "tracker")
    how = f" · {backend} backend" if backend and backend != "tracker" else ""
    return f"%%vram {cell} · {report.device}{cap}{how} · {report.wall_time * 1000:.0f} ms"


def report_text(report: CellReport) -> str:
    lines = [title(report)]
    scale = max(report.capacity or 0, report.peak.total, report.before.total, report.after.total, 1)
    rows = [("before", report.before), ("after", report.after), ("peak", report.peak)]
    shown = shown_categories(*[b for _, b in rows], report.delta)
    lines.append(table(rows, categories=shown))
    for name, b in rows:
        lines.append(f"  {name:<7}|{bar(b, scale)}| {format_bytes(b.total)}")
    lines.append(legend(shown))
    since = f"cell {report.previous}" if report.previous is not None else "before"
    ref = max(report.after.total, report.before.total, 1)
    lines.append(table([(f"Δ vs {since}"[:12], report.delta)], signed=True, reference=ref, categories=shown))
    experts = experts_line(report.peak)
    if experts:  # a mixture of experts: the routed experts' share of the model states at the peak
        lines.append(f"  mixture of experts at the peak: {experts}")
    top = [(label, n) for label, n in report.after.details("other").items() if n][:3]
    if top:
        lines.append("  other after: " + ", ".join(f"{lab or '?'} {format_bytes(n)}" for lab, n in top))
    if report.stats is not None and report.stats.reserved is not None:
        s = report.stats
        lines.append(
            f"  allocator: allocated {format_bytes(s.allocated)}, reserved {format_bytes(s.reserved)}"
            + (f", device used {format_bytes(s.used)} of {format_bytes(s.total or 0)}" if s.used is not None else "")
        )
    if report.trace is not None:
        sites = report.peak_sites(3)
        if sites:
            lines.append("  at the peak: " + ", ".join(f"{site} {format_bytes(n)}" for site, n in sites))
        modules = report.peak_modules(3)
        if modules:
            lines.append("  by module: " + ", ".join(f"{m} {format_bytes(n)}" for m, n in modules))
    if report.host is not None and report.host.worth_saying():
        lines.append(f"  {report.host.line()}")
    if report.oom is not None:
        lines.append(oom_text(report))
    if report.error and report.oom is None:
        lines.append(f"  the cell raised {report.error}")
    for a in report.advice:
        lines.append(f"  advice: {a}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def oom_text(report: CellReport) -> str:
    oom = report.oom
    assert oom is not None
    req = format_bytes(oom.requested) if oom.requested else "?"
    where = f" at {format_frame(oom.site[0])}" if oom.site else ""
    parts = [f"  OUT OF MEMORY: a request of {req}{where}; alive then: " + ", ".join(
        f"{LABELS[c]} {format_bytes(oom.live[c])}" for c in CATEGORIES if oom.live[c])]
    if oom.holders:
        parts.append("  held by: " + ", ".join(f"{n} {format_bytes(b)}" for n, b in oom.holders[:5]))
    return "\n".join(parts)


def now_stats_line(now: Any) -> str:
    """What the allocator says (CUDA), or what the budget leaves (CPU); "" when neither applies."""
    s = now.stats
    b = now.breakdown
    if s is not None:
        return (f"allocated {format_bytes(s.allocated)} · reserved {format_bytes(s.reserved or 0)}"
                + (f" · free {format_bytes(s.free)} of {format_bytes(s.total)}" if s.total and s.free is not None
                   else "")
                + (f" · outside PyTorch (CUDA context, other processes) {format_bytes(s.outside_allocator)}"
                   if s.outside_allocator is not None else ""))
    if now.capacity:
        return f"budget {format_bytes(now.capacity)} · free {format_bytes(max(now.capacity - b.total, 0))}"
    return ""


def now_text(now: Any) -> str:
    lines = [f"%vram · {now.device} now", table([("now", now.breakdown)])]
    extra = now_stats_line(now)
    if extra:
        lines.append("  " + extra)
    for note in getattr(now, "notes", ()) or ():
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def live_text(status: LiveStatus, *, cell: int | None, allocated: int | None = None) -> str:
    """One line (plus the split, when known) for a cell that is still running."""
    name = f"cell {cell}" if cell is not None else "block"
    step = getattr(status, "step", 0)
    phase = f" · {status.phase}" + (f" step {step}" if step else "") if status.phase else ""
    head = f"%%vram {name} · {status.device} · running {status.elapsed:.1f} s{phase}"
    if status.now is not None:
        head += f" · now {format_bytes(status.now)}"
        if status.peak is not None:
            head += f" · peak so far {format_bytes(status.peak)}"
    elif allocated is not None:
        head += f" · allocated now {format_bytes(allocated)}"
    else:
        head += f" · numbers when the cell ends ({status.backend} backend)"
    lines = [head]
    if status.breakdown is not None:
        lines.append("  " + ", ".join(f"{LABELS[c]} {format_bytes(status.breakdown[c])}"
                                      for c in shown_categories(status.breakdown)))
    return "\n".join(lines)
