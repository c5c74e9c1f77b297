"""The results of an estimate: frozen, plain numbers in bytes, rendering themselves through their renderers.

An :class:`Estimate` holds what every workload's estimate has (the peak by category, what the device needs, whether
it fits, the notes); a :class:`StepEstimate` (a training or inference step) and a :class:`GenerateEstimate` (a
``generate()`` call) add their own facts. What it takes to make an estimate again with other options (the model's
source, the inputs, the loss, the target) is not part of the result: the workload that made it (:class:`Workload`)
is kept beside the numbers for the what-if table and the searches, and is left behind when an estimate is pickled
or copied."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.breakdown import Breakdown, shown_categories
from ..core.rendered import Rendered

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
    partial: bool = False  # the row's step stopped early: its peak and needed are lower bounds


def fits_of(fits: bool | None, partial: bool) -> bool | None:
    """Whether a step fits, said as far as it is known: a partial estimate (the fake run stopped at an op it cannot
    run) counts only what ran before the stop, so its ``needed`` is a lower bound: ``False`` when that already exceeds
    the capacity, else ``None`` (not known, never a plain ``True``). A complete estimate's ``fits`` as it is."""
    return None if partial and fits else fits


@dataclass(frozen=True)
class Candidate:
    """A change worth trying from an estimate's options: its name in the what-if table, the options it changes,
    the sequential steps (or ``generate()`` calls) it takes per step of the baseline, and what it trades."""

    name: str
    changes: Mapping[str, Any]
    steps: float = 1.0
    note: str = ""


class Workload(Protocol):
    """What makes estimates of one model, inputs and target with any options: a step (``step/workload.py``) or a
    ``generate()`` call (``generate/workload.py``). Each traces the model once per configuration that changes the
    trace and replays that trace for every other option."""

    def evaluate(self, opts: Options) -> Estimate:
        """The estimate with ``opts`` (the same model, inputs and target), the workload beside it."""
        ...

    def candidates(self, est: Estimate) -> list[Candidate]:
        """The changes worth trying from ``est``, one what-if row each."""
        ...

    def compute_per_sample(self, est: Estimate) -> float:
        """FLOPs per sample (per sequence for generation) of ``est``: the what-if table's price of a change."""
        ...

    def remark(self, est: Estimate) -> str:
        """What a what-if row's note says of its own estimate beyond the change's words (``""``: nothing)."""
        ...

    def what_if(self, est: Estimate) -> list[Strategy]:
        """The what-if table of ``est`` (its baseline row first)."""
        ...

    def largest(self, est: Estimate, key: str, progress: Any = None) -> int:
        """The largest batch (``key="batch"``) or sequence (``"seq"``) whose estimate fits ``est``'s capacity."""
        ...

    SEQ_FIELD: str  # where the longest sequence goes in the estimate (``max_seq``, or ``max_prompt``)
    SEARCH_ORDER: tuple[str, ...]  # the order the searches run in


@dataclass(frozen=True)
class Estimate(Rendered):
    """What a workload needs. ``peak`` splits its peak into the same categories as ``%%vram``.

    ``needed`` is what the device must have: on CUDA the allocator's reserved memory at the peak plus the
    CUDA context; on the CPU the peak itself. ``fits`` compares it with ``capacity`` (a GPU's memory or a
    budget), ``None`` when neither was given. ``flops`` counts the workload's FLOPs by phase.

    ``partial``: the fake run stopped before the step's end (an op whose output depends on values fake tensors do not
    have; ``problem`` names it): ``peak`` and ``needed`` count what ran before it, lower bounds, and ``fits`` is
    ``False`` when even that exceeds the capacity, else ``None`` (:func:`fits_of`).
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
    strategies: tuple[Strategy, ...] = ()
    max_batch: int | None = None
    options: Options | None = field(default=None, repr=False, compare=False)
    rerun: Workload | None = field(default=None, repr=False, compare=False)  # beside the numbers, not one of them

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
    def experts(self) -> dict[str, int]:
        """A mixture of experts' routed experts at the peak: bytes of their parameters, gradients and optimizer state
        (``peak.experts``; zeros for a dense model)."""
        return self.peak.experts

    @property
    def traced(self) -> int:
        """Bytes of the peak that come from traced tensors (the rest is modelled)."""
        return self.peak.total - sum(n for _, n in self.modelled)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and copied as plain data: the workload (the user's model, inputs and loss) stays behind."""
        return {**self.__dict__, "rerun": None}

    # --- follow-ups ----------------------------------------------------------------------------------
    def what_if(self) -> pd.DataFrame:
        """The what-if table as a DataFrame (computed now if the estimate was made without it)."""
        rows = self.strategies or tuple(self.rerunnable().what_if(self))
        return strategies_frame(rows)

    def rerunnable(self) -> Workload:
        """The workload that makes this estimate again with other options (``ValueError`` if it has none)."""
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


@dataclass(frozen=True)
class StepEstimate(Estimate):
    """A training step's (or an inference step's) estimate: ``peak`` is the steady-state peak (the second step's)."""

    micro_batch: int | None = None
    loss: str = ""  # which loss the training step used (the model's own, the given loss_fn, or a stand-in)
    model_states: int = 0  # parameters + gradients + optimizer state per rank over the step (ZeRO's model states)
    max_seq: int | None = None  # the longest sequence (the inputs' dimension 1) that fits, when searched
    # paged (managed) memory, not in the device's allocated bytes: a rank's bitsandbytes paged optimizer state in CUDA
    # managed memory, outside ``peak`` and ``needed`` (on the GPU while it has room, moved to the host under pressure)
    paged: int = 0
    # host memory the rank keeps (offload: the optimizer's state; with FSDP2's CPUOffloadPolicy, offload="params", also
    # the sharded parameters and gradients), outside ``peak`` and ``needed``; ``pinned``: the page-locked part of it
    host: int = 0
    pinned: int = 0
    # the step assumed, in words: what stays alive when (the built-in step's convention and levers, or the user's step)
    step: str = ""
    # pinned host memory of the activations saved on the host (offload_activations), at its peak: outside ``peak``,
    # ``needed``, ``host`` and ``pinned``
    host_pinned: int = 0

    def _text(self) -> str:
        from .render.step import estimate_text

        return estimate_text(self)

    def _html(self) -> str:
        from .render.step import estimate_html

        return estimate_html(self)


@dataclass(frozen=True)
class GenerateEstimate(Estimate):
    """A ``generate()`` call's estimate: the cache is the ``kv_cache`` category; ``generation`` holds the facts of the
    loop (its bytes per token, the two phases, how it was modelled: ``generate/facts.py``)."""

    generation: Any = None
    max_prompt: int | None = None  # the longest prompt that fits with the new tokens, when searched

    def _text(self) -> str:
        from .render.generation import estimate_text

        return estimate_text(self)

    def _html(self) -> str:
        from .render.generation import estimate_html

        return estimate_html(self)


@dataclass(frozen=True)
class RankEstimate:
    """One role's estimate in a tensor- or pipeline-parallel job: the ``ranks`` that hold the same (a pipeline
    stage's ranks across the tensor- and data-parallel groups), its ``stages``, the peak by category and what the
    device needs on each of them."""

    ranks: tuple[int, ...]
    role: str
    stages: tuple[int, ...]
    peak: Breakdown
    after_forward: Breakdown
    needed: int
    reserved: int = 0
    capacity: int | None = None
    fits: bool | None = None
    model_states: int = 0
    modelled: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.peak.total


@dataclass(frozen=True)
class ParallelEstimate(StepEstimate):
    """A step of a job spread over ``tp × pp × dp`` ranks: ``ranks[r]`` is rank ``r``'s estimate (ranks with the
    same role share one :class:`RankEstimate`), ``roles`` each distinct one once, ``most_loaded`` the rank whose
    peak is the headline (the estimate's own ``peak``, ``needed`` … are that rank's); ``fits`` only if every rank
    fits."""

    ranks: tuple[RankEstimate, ...] = ()
    roles: tuple[RankEstimate, ...] = ()
    most_loaded: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: int | None = None
    schedule: str = ""

    def per_rank(self) -> pd.DataFrame:
        """Each role's peak by category, what it needs and whether it fits, one row per role (raw bytes)."""
        import pandas as pd

        rows = []
        for r in self.roles:
            row: dict[str, Any] = {"ranks": ", ".join(map(str, r.ranks)), "role": r.role}
            row.update({c: r.peak[c] for c in r.peak})
            row.update({"peak": r.peak.total, "needed": r.needed, "fits": r.fits})
            rows.append(row)
        return pd.DataFrame(rows).set_index("ranks")

    def _text(self) -> str:
        from .render.ranks import estimate_text

        return estimate_text(self)

    def _html(self) -> str:
        from .render.ranks import estimate_html

        return estimate_html(self)


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
