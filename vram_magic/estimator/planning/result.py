"""The result of a plan: combinations of strategies that make a model train (or generate) on the GPUs asked for,
ranked by their predicted step time — frozen, plain numbers, rendering themselves (``render.py``).

Every row shown was estimated exactly (``estimate(model, inputs, **row.options)`` gives its memory); the screen
behind them, every combination scored, may hold interpolated figures, and says so (``Scored.exact``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...core.breakdown import Breakdown
from ...core.rendered import Rendered

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class PlanRow:
    """One combination of strategies, estimated exactly. ``options`` are :func:`vram_magic.estimate`'s keyword
    arguments that give its memory; ``time`` splits ``step_time`` (seconds per optimizer step, or per ``generate()``
    call) into where it goes; ``throughput`` is samples (or tokens) per second across all GPUs."""

    name: str
    options: Mapping[str, Any]
    changes: tuple[str, ...]
    peak: Breakdown
    needed: int
    fits: bool | None
    step_time: float
    throughput: float
    time: Mapping[str, float]
    micro_batch: int
    accumulate: int
    numerics: tuple[str, ...] = ()  # what changes the training's math (mixed precision, LoRA, another optimizer, ...)
    code: tuple[str, ...] = ()  # what to write in the training loop
    tradeoffs: tuple[str, ...] = ()  # what it costs besides time
    exact: bool = True
    collectives: tuple[Any, ...] = ()  # timing.overlap.Collective: each kind's seconds, how much is exposed, and why


@dataclass(frozen=True)
class Scored:
    """A combination as the screen scored it (interpolated where ``exact`` is False)."""

    name: str
    needed: int
    step_time: float
    fits: bool
    exact: bool


@dataclass(frozen=True)
class Plan(Rendered):
    """The fastest ways that fit, first (``rows``), then the closest that do not when nothing fits; ``scored`` is every
    combination the search scored, for :meth:`figure`."""

    model: str
    device: str
    gpu: str | None
    gpus: int
    capacity: int | None
    global_batch: int
    unit: str  # "samples/s" or "tokens/s"
    rows: tuple[PlanRow, ...]
    scored: tuple[Scored, ...] = ()
    assumptions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    calibration: tuple[float, str] | None = None  # (factor applied to every time, what it was measured on)
    traced: int = 0  # fake runs made
    wall_time: float = 0.0
    bounded: int = 0  # combinations left unscored: a lower bound of their time already above the rows found
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # what plan() was given
    step: str | None = None  # the name of the user's step a plan of step=fn traced as written

    @property
    def best(self) -> PlanRow | None:
        """The fastest row that fits (``None`` when none does)."""
        return next((r for r in self.rows if r.fits), None)

    def to_frame(self) -> pd.DataFrame:
        """The rows as a DataFrame: raw numbers (bytes, seconds), one column per part of the time."""
        import pandas as pd

        records = []
        for i, r in enumerate(self.rows):
            rec: dict[str, Any] = {"rank": i, "plan": r.name, "needed": r.needed, "peak": r.peak.total, "fits": r.fits,
                                   "step_time": r.step_time, f"throughput ({self.unit})": r.throughput,
                                   "micro_batch": r.micro_batch, "accumulate": r.accumulate,
                                   "numerics": "; ".join(r.numerics)}
            rec.update({f"time: {k}": v for k, v in r.time.items()})
            records.append(rec)
        return pd.DataFrame(records).set_index("rank")

    def figure(self) -> Figure:
        """Memory against step time for every combination scored, the GPU's capacity as a line, the rows shown
        marked and the fastest that fits named."""
        from .figure import plan_figure

        return plan_figure(self)

    def calibrate(self, report: Any, row: int = 0) -> Plan:
        """This plan with every time scaled so that row ``row``'s step time is what ``report`` measured: a ``%%vram``
        report (or a ``vram_magic.measure()`` result) of a cell that ran one step of that row."""
        measured = getattr(report, "wall_time", None)
        if not isinstance(measured, (int, float)) or measured <= 0:
            raise TypeError("calibrate() needs a %%vram report or a vram_magic.measure() result of a cell that ran "
                            f"one step (its wall_time), not {type(report).__name__}")
        if not 0 <= row < len(self.rows):
            raise ValueError(f"row must be one of 0 … {len(self.rows) - 1}, not {row}")
        base = self.rows[row].step_time / (self.calibration[0] if self.calibration else 1.0)
        factor = measured / base if base > 0 else 1.0
        scale = factor / (self.calibration[0] if self.calibration else 1.0)
        rows = tuple(replace(r, step_time=r.step_time * scale, throughput=r.throughput / scale,
                             time={k: v * scale for k, v in r.time.items()}) for r in self.rows)
        scored = tuple(replace(s, step_time=s.step_time * scale) for s in self.scored)
        where = f"cell {report.cell}" if getattr(report, "cell", None) is not None else "a measured block"
        return replace(self, rows=rows, scored=scored,
                       calibration=(factor, f"{where}: {measured * 1e3:.1f} ms measured for row {row}"))

    def _text(self) -> str:
        from .render import plan_text

        return plan_text(self)

    def _html(self) -> str:
        from .render import plan_html

        return plan_html(self)


@dataclass(frozen=True)
class PlanCheck(Rendered):
    """A measured cell set beside the plan row it claims to follow: memory by category and time, predicted and
    measured (``%%vram --plan NAME[:ROW]``)."""

    row: PlanRow
    index: int
    measured: Breakdown
    measured_time: float
    device: str  # where the cell ran
    planned_device: str
    calibrated: bool = False
    cell: int | None = None

    @property
    def ratio(self) -> float:
        """Measured over predicted step time."""
        return self.measured_time / self.row.step_time if self.row.step_time > 0 else float("nan")

    def _text(self) -> str:
        from .render import check_text

        return check_text(self)

    def _html(self) -> str:
        from .render import check_html

        return check_html(self)


def check(plan: Plan, index: int, report: Any) -> PlanCheck:
    """``report`` (a ``%%vram`` report or a ``measure()`` result) set beside ``plan``'s row ``index``."""
    row = plan.rows[index]
    return PlanCheck(row, index, report.peak, float(getattr(report, "wall_time", 0.0)), str(report.device),
                     plan.device, plan.calibration is not None, getattr(report, "cell", None))


def plan_row(value: Any, text: str) -> tuple[Plan, int]:
    """``(plan, row)`` from ``%%vram --plan NAME[:ROW]`` (``value`` the object NAME holds); ``ValueError`` saying what
    is accepted."""
    name, _, row = text.partition(":")
    if not isinstance(value, Plan):
        raise ValueError(f"--plan {name}: {name!r} holds no plan (make one with %vram_plan … -o {name})")
    try:
        index = int(row) if row else 0
    except ValueError:
        raise ValueError(f"--plan {text}: the row must be a number, e.g. --plan {name}:0") from None
    if not 0 <= index < len(value.rows):
        raise ValueError(f"--plan {text}: the plan has rows 0 … {len(value.rows) - 1}")
    return value, index
