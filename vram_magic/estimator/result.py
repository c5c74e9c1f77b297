"""The result of an estimate: frozen, plain numbers in bytes, rendering itself (text and HTML).

What it takes to make an estimate again with other options (the model's source, the inputs, the loss, the
target) is not part of the result: a re-run handle (:class:`Rerun`, made by the runner) is kept beside the
numbers for the what-if table and the batch and sequence searches, and is left behind when an estimate is
pickled or copied."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..breakdown import CATEGORIES, Breakdown, shown_categories
from ..units import format_bytes

if TYPE_CHECKING:
    import pandas as pd

    from .options import Options


@dataclass(frozen=True)
class Strategy:
    """One row of the what-if table."""

    name: str
    peak: int
    needed: int
    saving: int
    compute: float  # FLOPs per sample relative to the baseline
    steps: float  # sequential steps per optimizer update relative to the baseline
    fits: bool | None
    note: str = ""


class Rerun(Protocol):
    """What makes an estimate again with other options (``core.StepRerun``, ``generate_estimate.GenerateRerun``)."""

    def evaluate(self, opts: Options) -> Estimate:
        """The estimate with ``opts`` instead (the same model, inputs and target), its handle beside it."""
        ...

    def what_if(self, est: Estimate) -> list[Strategy]:
        """The what-if table of ``est`` (its baseline row first)."""
        ...


@dataclass(frozen=True)
class Estimate:
    """What a step needs. ``peak`` splits the steady-state peak into the same categories as ``%%vram``.

    ``needed`` is what the device must have: on CUDA the allocator's reserved memory at the peak plus the
    CUDA context; on the CPU the peak itself. ``fits`` compares it with ``capacity`` (a GPU's memory or a
    budget), ``None`` when neither was given.
    """

    model: str
    description: str
    device: str
    peak: Breakdown
    after_forward: Breakdown
    top_modules: tuple[tuple[str, int], ...] = ()
    flops: Mapping[str, int] = field(default_factory=dict)
    batch: int | None = None
    seq: int | None = None
    micro_batch: int | None = None
    parameters: int = 0
    gpu: str | None = None
    capacity: int | None = None
    reserved: int = 0
    context: int = 0
    needed: int = 0
    fits: bool | None = None
    partial: bool = False
    problem: str | None = None
    modelled: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = ()
    wall_time: float = 0.0
    loss: str = ""  # which loss the training step used (the model's own, the given loss_fn, or a stand-in)
    model_states: int = 0  # parameters + gradients + optimizer state per rank over the step (ZeRO's model states)
    strategies: tuple[Strategy, ...] = ()
    max_batch: int | None = None
    max_seq: int | None = None
    # generate= estimates: the cache per token, the two phases, how the loop was modelled (generate_facts.Generation)
    generation: Any = None
    options: Options | None = field(default=None, repr=False, compare=False)
    rerun: Rerun | None = field(default=None, repr=False, compare=False)  # beside the numbers, not one of them

    @property
    def total(self) -> int:
        return self.peak.total

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.needed

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def traced(self) -> int:
        """Bytes of the peak that come from traced tensors (the rest is modelled)."""
        return self.peak.total - sum(n for _, n in self.modelled)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and copied as plain data: the re-run handle (the user's model, inputs and loss) stays behind."""
        return {**self.__dict__, "rerun": None}

    # --- follow-ups ----------------------------------------------------------------------------------
    def what_if(self) -> pd.DataFrame:
        """The what-if table as a DataFrame (computed now if the estimate was made without it)."""
        rows = self.strategies or tuple(self.rerunnable().what_if(self))
        return strategies_frame(rows)

    def rerunnable(self) -> Rerun:
        """The handle that makes this estimate again with other options (``ValueError`` if it has none)."""
        if self.rerun is None or self.options is None:
            raise ValueError("this estimate cannot be re-run (it was not made by vram_magic.estimate, or it was "
                             "copied or unpickled: only its numbers travel)")
        return self.rerun

    def compare(self, report: Any) -> pd.DataFrame:
        """Estimate and measurement side by side per category: ``report`` is a ``%%vram`` report (or a
        ``vram_magic.measure()`` result); its ``peak`` is compared with this estimate's ``peak``."""
        import pandas as pd

        measured = getattr(report, "peak", None)
        if not isinstance(measured, Mapping):
            raise TypeError("compare() needs a %%vram report or a vram_magic.measure() result (something with a "
                            f"peak breakdown), not {type(report).__name__}")
        rows = []
        for c in list(shown_categories(self.peak, measured)) + ["total"]:  # the KV cache where either has one
            est = self.peak.total if c == "total" else self.peak[c]
            got = measured.total if c == "total" else measured.get(c, 0)  # type: ignore[attr-defined]
            err = est - got
            rows.append({"category": c, "estimate": est, "measured": got, "error": err,
                         "error %": (100.0 * err / got) if got else float("nan")})
        return pd.DataFrame(rows).set_index("category")

    # --- rendering -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        from .render.step import estimate_text

        return estimate_text(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from .render.step import estimate_html

        return {"text/plain": str(self), "text/html": estimate_html(self)}

    def summary_lines(self) -> list[str]:
        """What the step trained on and what it keeps for the whole step: the loss, the model states."""
        lines = []
        if self.loss:
            lines.append(f"loss: {self.loss}")
        if self.model_states and self.options is not None and not self.options.inference:
            per_rank = " per rank" if self.options.zero else ""
            lines.append(f"model states{per_rank} (parameters + gradients + optimizer state): "
                         f"{format_bytes(self.model_states)}")
        return lines

    def verdict(self) -> str:
        where = self.gpu or (format_bytes(self.capacity) if self.capacity else None)
        if self.capacity is None or where is None:
            return f"needs {format_bytes(self.needed)}" + (" on the device" if self.device == "cuda" else "")
        room = self.capacity - self.needed
        if room >= 0:
            return (f"fits {where}: needs {format_bytes(self.needed)} of {format_bytes(self.capacity)}, "
                    f"headroom {format_bytes(room)} ({100 * room / self.capacity:.0f} %)")
        return (f"does NOT fit {where}: needs {format_bytes(self.needed)} of {format_bytes(self.capacity)}, "
                f"{format_bytes(-room)} short")


def breakdown_bytes(b: Breakdown) -> dict[str, int]:
    return {c: b[c] for c in CATEGORIES}


def strategies_frame(rows: tuple[Strategy, ...] | list[Strategy]) -> pd.DataFrame:
    """The what-if rows as a DataFrame (raw numbers; savings positive, in bytes and as a share of the baseline)."""
    import pandas as pd

    base = rows[0].needed if rows else 0
    return pd.DataFrame([{
        "strategy": r.name,
        "peak": r.peak,
        "needed": r.needed,
        "saving": -r.saving,
        "saving %": 100.0 * -r.saving / base if base else float("nan"),
        "compute ×": r.compute,
        "steps ×": r.steps,
        "fits": r.fits,
        "note": r.note,
    } for r in rows]).set_index("strategy")
