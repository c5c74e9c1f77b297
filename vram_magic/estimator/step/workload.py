"""A training or inference step as a workload: traced once per configuration that changes the trace, each
estimate a replay of that trace for one rank of the target (``replay.py``), with its candidate changes
(``candidates.py``) and its FLOPs per sample."""

from __future__ import annotations

from typing import Any

from ..device import Target
from ..device.sdpa import target_capability
from ..fake.request import Request
from ..followups.search import bisected
from ..followups.whatif import what_if
from ..options import Options
from ..replay import from_trace
from ..result import Candidate, StepEstimate, Strategy, fits_of
from ..tracing.kept import KeptTraces
from ..tracing.traced import FakeRun
from .candidates import candidates
from .low_bit_optimizers import paged_note, paged_share
from .trace import trace_step

#: traces a workload keeps (a what-if table makes about twenty; a plan's screen more)
KEPT_TRACES = 64


class StepWorkload:
    """What makes a step's estimate with any options: the request (the model's source, held weakly when it is a
    module; the inputs as shapes; the loss), the target and the traces made so far. Kept beside an estimate's numbers
    (``Estimate.rerun``) for the what-if table, the searches and the planner."""

    def __init__(self, request: Request, target: Target) -> None:
        self.request, self.target = request, target
        self._traces: KeptTraces[FakeRun] = KeptTraces(KEPT_TRACES)
        self._states: dict[Any, Any] = {}  # the optimizer state the first fake run's first step left (first_step.py)

    @property
    def traced(self) -> int:
        """Fake runs made (the rest of the estimates were replays)."""
        return self._traces.made

    def trace(self, opts: Options) -> FakeRun:
        """The fake run for ``opts``, made once per configuration that changes it (:meth:`Options.trace_key`, and the
        GPU's compute capability, which chooses CUDA's attention kernels)."""
        sdpa = target_capability(opts.device, self.target.gpu)
        return self._traces.get((opts.trace_key(), sdpa), lambda: trace_step(self.request, opts, sdpa, self._states))

    def evaluate(self, opts: Options) -> StepEstimate:
        if opts.parallel:  # a tensor- or pipeline-parallel job: one trace per rank's role
            from .ranks import evaluate_ranks

            return evaluate_ranks(self, opts)
        trace = self.trace(opts)
        r = from_trace(trace, opts, self.target)
        gpu = self.target.gpu
        paged = paged_share(trace.paged, opts)
        return StepEstimate(
            model=self.request.name, description=opts.describe(), device=opts.device, peak=r.peak,
            after_forward=r.after_forward, top_modules=r.top_modules, flops=dict(trace.flops), batch=trace.batch,
            seq=trace.seq, micro_batch=trace.micro_batch, parameters=trace.param_count,
            gpu=gpu.name if gpu is not None else None, capacity=r.capacity, reserved=r.reserved, context=r.context,
            needed=r.needed, fits=fits_of(r.fits, trace.problem is not None), partial=trace.problem is not None,
            problem=trace.problem,
            modelled=r.modelled, notes=r.notes + ((paged_note(paged),) if paged else ()), wall_time=trace.wall,
            loss=trace.loss, model_states=r.model_states, paged=paged, host=r.host, pinned=r.pinned, step=trace.step,
            host_pinned=trace.host_pinned, options=opts, rerun=self)

    def candidates(self, est: Any) -> list[Candidate]:
        assert est.options is not None
        return candidates(est.options, est.batch)

    def compute_per_sample(self, est: Any) -> float:
        return est.total_flops / max(est.batch or 1, 1)

    def remark(self, est: Any) -> str:
        """What a what-if row adds to its note about its own estimate (nothing, for a step)."""
        return ""

    def what_if(self, est: Any) -> list[Strategy]:
        return what_if(self, est)

    def largest(self, est: Any, key: str, progress: Any = None) -> int:
        """The largest batch (``key="batch"``) or sequence (``"seq"``) that fits ``est``'s capacity."""
        return bisected(est, key, progress)

    #: where :meth:`largest` of the sequence goes in the estimate, and the order the searches run in
    SEQ_FIELD = "max_seq"
    SEARCH_ORDER = ("batch", "seq")
