"""The CPU as a device to time steps on: what this machine's PyTorch achieves, measured once per process.

A time prediction for ``device="cpu"`` needs the figures of the CPU it runs on, which no catalogue holds. Matmul
throughput differs by dtype and layout by an order of magnitude or more (bf16 and fp16 GEMMs are fast only where the
CPU has AVX-512's bf16/fp16 instructions or AMX; elsewhere PyTorch's fallback kernels run, at a rate that depends on
which operand is transposed and on the row length), and with the thread count. So the profile times, at the thread
count PyTorch uses now, on this thread's CPU clock (``time.thread_time``: a busy machine's other processes do not
count) with one thread, else on the wall clock:

* matmuls per dtype and layout at shapes like a step's (tall-skinny, wide, a range of row lengths), to which
  ``cpu_gemm.GemmFit`` is fitted;
* a convolution's forward and backward and the CPU's flash attention forward and backward, per dtype;
* an in-place and an allocating elementwise op at sizes from within the caches to well beyond them: seconds per byte
  moved, and per byte of a result allocated (a fresh result's pages are faulted in and zeroed);
* the elementwise ops that compute more than they move — random numbers, ``tanh``, ``gelu``, softmax, layer norm —
  per element, and the extra cost per element of bf16 and fp16 (converted to fp32 and back);
* a tiny training step, whose time per op is what each op of a step costs beyond its work (dispatch, autograd, the
  model's and the optimizer's Python).

It takes about a second and a half of CPU on one thread (its ops are counted under a dispatch mode, whose first use
in a process imports sympy: seconds, not counted, and already paid by the estimate a plan makes first), and
:func:`cpu_profile` keeps it for the process (per thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cpu_gemm import GemmFit, fit_gemm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: GEMMs timed per dtype and layout, ``(m, k, n)``: row lengths 64 … 2048 at two inner dimensions, tall-skinny and
#: wide ones, a tiny one for the fixed cost, a few with few rows (a small batch's); the half types at small m (they
#: are slow), 8 and 32 so that the cost per element of the right operand (k·n, the same for every m) and per
#: multiply-add (m·n·k) are told apart (at one m they are proportional, and a step's m = 512 extrapolated either way:
#: bf16 A·B at 512³ read 1.2 to 3.2 GFLOP/s from one process to the next), fp32 at m = 16 … 2048 (BLAS's own
#: efficiency grows with it)
GEMM_SHAPES = {
    "fp32": ((64, 512, 64), (64, 512, 256), (64, 512, 1024), (64, 512, 2048), (512, 128, 64), (512, 128, 256),
             (512, 128, 1024), (512, 128, 2048), (64, 2048, 256), (512, 64, 1024), (2048, 64, 256), (8, 64, 64),
             (32, 512, 2048), (16, 1024, 512), (512, 1024, 256)),
    "half": ((8, 256, 64), (8, 256, 256), (8, 256, 1024), (8, 256, 2048), (32, 128, 64), (32, 128, 256),
             (32, 128, 1024), (32, 128, 2048), (64, 64, 256), (256, 64, 256), (4, 64, 64), (8, 1024, 256),
             (8, 2048, 256), (8, 2048, 1024)),
}
LAYOUT_NAMES = ("NN", "NT", "TN")
#: the dtypes timed up front: fp32 and bf16, what a CPU plan chooses between; fp16's matmuls are timed when an op
#: first asks for them, its convolutions and attention taken as bf16's (the same fallback kernels, within 2 % of each
#: other in forward convolutions here)
HALF_TIMED = ("fp32", "bf16")
#: convolutions timed per dtype, ``(batch, image size)`` of 32 channels: 38 and 302 MFLOP in fp32, 19 in bf16
CONV_SIZES = {"fp32": ((2, 32), (16, 32)), "bf16": ((4, 16),)}
#: a larger bf16 convolution (302 MFLOP), and bf16 matmuls at fp32's shapes (up to 512 rows), timed only where the small
#: bf16 convolution ran at least this fraction of the small fp32 one's rate: a CPU with bf16 in hardware (AVX-512 BF16,
#: AMX), whose oneDNN rates grow with the work as fp32's do. Measured on one (AMD EPYC, AVX-512 BF16, one thread): the
#: small bf16 convolution ran 114 GFLOP/s against fp32's 90, and a conv net's bf16 step took 0.63x its fp32 step where
#: the small size alone predicted 1.23x; the matmul fit from the small half shapes alone read bf16 A·B at 512³ anywhere
#: from 780 to 1,390 GFLOP/s from one process to the next (beyond the core's peak), with fp32's shapes 400-460. Where
#: bf16 falls back to a slow kernel (AVX2), its rate does not grow and large probes would take seconds.
BF16_CONV_LARGE, BF16_CONV_FAST = (16, 32), 0.5
#: elementwise sizes timed, bytes per tensor (fp32), and the bytes of a pool that no cache holds
SIZES = (64 << 10, 1 << 20, 8 << 20)
POOL = 64 << 20
#: elements of the per-element ops timed (1 MiB of fp32)
ELEMENTS = 1 << 18
#: bare ops timed in a row for the cost of one (a single call's figure would hold the clock's own cost)
LOOP = 256


def _log_interpolated(pts: tuple[tuple[float, float, float], ...], x: float, col: int) -> float:
    """Column ``col`` of ``pts`` (sorted by their first column) at ``x``, geometric between the points around it (log
    linear in x), the ends' values beyond them."""
    if x <= pts[0][0]:
        return pts[0][col]
    for a, b in zip(pts, pts[1:]):
        if x <= b[0]:
            w = (math.log(x) - math.log(a[0])) / (math.log(b[0]) - math.log(a[0]))
            return math.exp(math.log(a[col]) + (math.log(b[col]) - math.log(a[col])) * w)
    return pts[-1][col]


@dataclass(frozen=True)
class CpuProfile:
    """What this CPU achieved. ``gemm[dtype][layout]``: the fitted matmul model; ``conv[dtype]``: ``(forward FLOPs,
    forward FLOP/s, backward FLOP/s)`` of each convolution timed, smallest first; ``attention[dtype]``: ``(forward,
    backward)`` FLOP/s at 128 tokens; ``attention_lengths[dtype]``: ``(tokens, forward FLOP/s, backward FLOP/s)`` at
    each length timed, shortest first; ``conv_fixed``: seconds a convolution costs at least; ``memory``: ``(bytes an op
    moved, seconds per byte moved, seconds per byte allocated)`` by size, smallest first; ``element[kind]``: seconds
    per element of the ops that compute more than they move (fp32); ``convert[dtype]``: extra seconds per element in
    bf16 or fp16; ``op_overhead``: seconds each op of a training step adds; ``dispatch``: seconds of a bare op;
    ``seconds`` and ``cpu_seconds``: what measuring it took, on the wall clock and on this thread's CPU clock (on a
    busy machine the wall clock's figure is several times the other)."""

    threads: int
    gemm: dict[str, dict[str, GemmFit]]
    conv: dict[str, tuple[tuple[float, float, float], ...]]
    conv_fixed: float
    attention: dict[str, tuple[float, float]]
    memory: tuple[tuple[float, float, float], ...]
    element: dict[str, float]
    convert: dict[str, float]
    op_overhead: float
    dispatch: float
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    attention_lengths: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)

    @property
    def bandwidth(self) -> float:
        """Bytes/s an in-place op reaches on tensors beyond the caches."""
        return 1.0 / self.memory[-1][1]

    @property
    def cached_bandwidth(self) -> float:
        """Bytes/s an in-place op reaches within the caches."""
        return 1.0 / self.memory[0][1]

    def per_byte(self, nbytes: float) -> tuple[float, float]:
        """``(seconds per byte moved, per byte allocated)`` of an op moving ``nbytes``: interpolated in log size
        between the sizes timed, the ends beyond them."""
        pts = self.memory
        if nbytes <= pts[0][0]:
            return pts[0][1], pts[0][2]
        for (sa, ma, fa), (sb, mb, fb) in zip(pts, pts[1:]):
            if nbytes <= sb:
                w = (math.log(nbytes) - math.log(sa)) / (math.log(sb) - math.log(sa))
                return ma + (mb - ma) * w, fa + (fb - fa) * w
        return pts[-1][1], pts[-1][2]

    def conv_rate(self, dtype: str, forward: bool, flops: float) -> float:
        """FLOP/s of a convolution of ``dtype`` (fp16 as bf16, other dtypes as fp32) in either direction whose
        forward does ``flops``: interpolated in log FLOPs between the sizes timed (oneDNN's rate grows with the
        work), the ends' rates beyond them."""
        pts = self.conv.get(dtype) or self.conv.get("bf16" if dtype == "fp16" else "fp32") or self.conv["fp32"]
        col = 1 if forward else 2
        return _log_interpolated(pts, flops, col)

    def attention_rate(self, dtype: str, forward: bool, tokens: float | None) -> float:
        """FLOP/s of the CPU's flash attention of ``dtype`` (fp16 as bf16, other dtypes as fp32) in either direction,
        over ``tokens`` (the geometric mean of the query and key lengths): interpolated in log tokens between the
        lengths timed, the ends' rates beyond them; at 128 tokens where the length is not known. The kernel works in
        blocks, so short sequences run far below its rate on long ones (bf16's backward here: 17 GFLOP/s at 65
        tokens, 42 at 128, 121 at 512)."""
        name = dtype if dtype in self.attention else ("bf16" if dtype == "fp16" and "bf16" in self.attention
                                                      else "fp32")
        col = 1 if forward else 2
        pts = self.attention_lengths.get(name)
        if not pts or not tokens:
            return self.attention[name][col - 1]
        return _log_interpolated(pts, tokens, col)

    def gemm_fit(self, dtype: str, layout: str) -> GemmFit:
        """The matmul model of ``dtype`` (fp32's for integer and other dtypes), timed now if it was not yet; a layout
        with both operands transposed (rare in a step) as the slowest of the others."""
        if dtype not in DTYPES:
            dtype = "fp32"
        if dtype not in self.gemm:
            with torch.no_grad():
                self.gemm[dtype] = measure_gemms(dtype)
        by_layout = self.gemm[dtype]
        if layout in by_layout:
            return by_layout[layout]
        return max(by_layout.values(), key=lambda f: f.seconds(256, 256, 256))

    def matmul_rate(self, dtype: str, flops: float) -> float:
        """FLOP/s of a square GEMM of ``flops`` in ``dtype`` (rows as a linear layer's forward reads them): the rate a
        matmul whose shape is unknown is timed at."""
        n = max((flops / 2.0) ** (1 / 3), 1.0)
        return self.gemm_fit(dtype, "NT").rate(n, n, n)

    def describe(self) -> str:
        rates = ", ".join(f"{d} {self.gemm_fit(d, 'NN').rate(512, 512, 512) / 1e9:.1f}/"
                          f"{self.gemm_fit(d, 'NT').rate(512, 512, 512) / 1e9:.1f}/"
                          f"{self.gemm_fit(d, 'TN').rate(512, 512, 512) / 1e9:.1f}" for d in self.gemm)
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        took = f"{self.cpu_seconds:.1f} s of CPU, {self.seconds:.1f} s wall"
        return (f"this CPU, {threads} (measured in {took}): 512³ matmul GFLOP/s (A·B / A·Bᵀ / Aᵀ·B) "
                f"{rates}; memory {self.bandwidth / 1e9:.1f} GB/s ({self.cached_bandwidth / 1e9:.1f} within the "
                f"caches); {self.op_overhead * 1e6:.1f} µs per op of a training step")


def _clock() -> Callable[[], float]:
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after an untimed one: the others were slowed by something else."""
    probes = Probes()
    probes.add(None, fn, repeats)
    return probes.run()[None]


class Probes:
    """Timed calls run round by round, each call's figure the fastest of its rounds: a burst of load on a shared
    machine slows one round of every figure rather than every round of one figure."""

    def __init__(self) -> None:
        self.calls: dict[Any, tuple[Callable[[], object], int]] = {}
        self.best: dict[Any, float] = {}

    def add(self, key: Any, fn: Callable[[], object], rounds: int = 3) -> None:
        self.calls[key] = (fn, rounds)

    def run(self) -> dict[Any, float]:
        clock = _clock()
        for fn, _ in self.calls.values():  # once untimed: first calls pack, allocate, load
            fn()
        for r in range(max((n for _, n in self.calls.values()), default=0)):
            for key, (fn, rounds) in self.calls.items():
                if r < rounds:
                    t = clock()
                    fn()
                    self.best[key] = min(self.best.get(key, math.inf), max(clock() - t, 1e-9))
        return self.best


#: random numbers the matmuls' operands are copied from (as many as the largest operand of :data:`GEMM_SHAPES` holds):
#: drawing each operand's own took a quarter of the profile's time
OPERAND_POOL = max(max(m * k, k * n) for shapes in GEMM_SHAPES.values() for m, k, n in shapes)


def _operand(rows: int, cols: int, transposed: bool, dtype: torch.dtype, pool: torch.Tensor) -> torch.Tensor:
    """A ``rows × cols`` matrix of ``pool``'s random numbers, stored row-major, or column-major as a transposed view;
    a copy of its own (two operands never share memory)."""
    a, b = (cols, rows) if transposed else (rows, cols)
    out = pool[:a * b].view(a, b).to(dtype, copy=True)
    return out.t() if transposed else out


def add_gemms(probes: Probes, name: str, shapes: str | None = None) -> None:
    """Probes ``("gemm", dtype, layout, m, n, k)`` of :data:`GEMM_SHAPES` (the dtype's own, or ``shapes``'s)."""
    dtype = DTYPES[name]
    shapes = shapes or ("fp32" if name == "fp32" else "half")
    pool = torch.randn(OPERAND_POOL, generator=torch.Generator().manual_seed(0))
    for layout in LAYOUT_NAMES:
        for m, k, n in GEMM_SHAPES[shapes]:
            a = _operand(m, k, layout[0] == "T", dtype, pool)
            b = _operand(k, n, layout[1] == "T", dtype, pool)
            slow = 2 * m * n * k > (1 << 27 if shapes == "fp32" else 1 << 22)
            probes.add(("gemm", name, layout, m, n, k), lambda a=a, b=b: torch.mm(a, b), 2 if slow else 3)


def gemm_fits(best: dict[Any, float], name: str) -> dict[str, GemmFit]:
    timed = [(key[2:], t) for key, t in best.items() if key[0] == "gemm" and key[1] == name]
    return {layout: fit_gemm([(m, n, k, t) for (lay, m, n, k), t in timed if lay == layout]) for layout in LAYOUT_NAMES}


def measure_gemms(name: str) -> dict[str, GemmFit]:
    """The matmul model of dtype ``name`` per layout, fitted to :data:`GEMM_SHAPES` timed."""
    probes = Probes()
    add_gemms(probes, name)
    return gemm_fits(probes.run(), name)


_CONV_ARGS = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _add_conv(probes: Probes, name: str, batch: int, size: int) -> float:
    """Probes ``("conv", dtype, forward?, batch)`` of a 3×3 convolution of 32 channels on ``batch`` images of
    ``size``²; returns its forward FLOPs (the backward's are twice them)."""
    x = torch.randn(batch, 32, size, size).to(DTYPES[name])
    w = torch.randn(32, 32, 3, 3).to(DTYPES[name])
    y = torch.ops.aten.convolution(x, w, None, *_CONV_ARGS)
    g = torch.randn_like(y)
    probes.add(("conv", name, True, batch), lambda: torch.ops.aten.convolution(x, w, None, *_CONV_ARGS), 2)
    probes.add(("conv", name, False, batch), lambda: torch.ops.aten.convolution_backward(g, x, w, None, *_CONV_ARGS,
                                                                                 [True, True, False]), 2)
    return 2.0 * y.numel() * w[0].numel()


#: sequence lengths the flash attention is timed at (4 heads of 64, batch 1); 128 is the rate used where a trace does
#: not know an attention's length
ATTENTION_LENGTHS = (64, 128, 512)


def _add_attention(probes: Probes, name: str) -> dict[int, tuple[float, float]]:
    """Probes ``("attention", dtype, forward?, tokens)`` of the CPU's flash attention at each of
    :data:`ATTENTION_LENGTHS`; returns each length's forward and backward FLOPs."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    op, back = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    flops = {}
    for tokens in ATTENTION_LENGTHS:
        q, k, v = (torch.randn(1, 4, tokens, 64).to(DTYPES[name]) for _ in range(3))
        out, lse = op(q, k, v)
        g = torch.randn_like(out)
        probes.add(("attention", name, True, tokens), lambda q=q, k=k, v=v: op(q, k, v), 2)
        probes.add(("attention", name, False, tokens),
                   lambda g=g, q=q, k=k, v=v, out=out, lse=lse: back(g, q, k, v, out, lse, 0.0, False), 2)
        flops[tokens] = (sdpa_flop_count(q.shape, k.shape, v.shape),
                         sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    return flops


def _add_memory(probes: Probes, pool: torch.Tensor) -> None:
    """Probes of adds at each of :data:`SIZES`: in place over tensors of ``pool`` (a buffer no cache holds), into
    results in ``pool``, and (``"cached"``) in place on one 1 MiB tensor again and again; ``"dispatch"``, a bare op."""
    one = torch.ones(1)
    probes.add(("dispatch",), lambda: [one.add_(one) for _ in range(LOOP)], 5)
    a, b = torch.ones(1 << 18), torch.ones(1 << 18)
    probes.add(("cached",), lambda: [a.add_(b) for _ in range(8)], 3)
    for size in SIZES:
        n = size // 4
        count = min(max(4, POOL // size), pool.numel() // n)
        tensors = [pool[i * n:(i + 1) * n] for i in range(count)]
        x, y = torch.ones(n), torch.ones(n)
        if size == SIZES[0]:  # a step's small tensors are often just written: within the caches
            probes.add(("inplace", size), lambda x=x, y=y, c=count: [x.add_(y) for _ in range(c)])
        else:
            probes.add(("inplace", size), lambda y=y, ts=tensors: [t.add_(y) for t in ts], 2)
        probes.add(("written", size), lambda x=x, y=y, ts=tensors: [torch.add(x, y, out=t) for t in ts], 2)


def _memory(best: dict[Any, float]) -> tuple[tuple[float, float, float], ...]:
    """Per size: ``(bytes moved, seconds per byte moved, per byte of a result allocated)``: the in-place add moves
    three tensors; what writing a result into a tensor no cache holds adds to the same add within the caches is what
    a fresh result costs (its lines are read for ownership, then written back). The bare op's dispatch is taken off."""
    dispatch = best[("dispatch",)] / LOOP
    cached = (best[("cached",)] / 8 - dispatch) / (3 * 4 * (1 << 18))
    out = []
    for size in SIZES:
        count = max(4, POOL // size)
        inplace = best[("inplace", size)] / count - dispatch
        written = best[("written", size)] / count - dispatch
        out.append((3.0 * size, max(inplace, 1e-12) / (3 * size), max(written - cached * 3 * size, 0.0) / size))
    return tuple(out)


def _add_elements(probes: Probes) -> None:
    """Probes ``("element", kind)`` of the per-element kinds (fp32), and ``("add", dtype)`` of an add within the
    caches per dtype."""
    x = torch.randn(ELEMENTS)
    square = x.view(512, -1)
    images = x.view(16, 16, 32, 32)
    weight, bias = torch.ones(square.shape[-1]), torch.zeros(square.shape[-1])
    channels = (torch.zeros(16), torch.ones(16))
    ops: dict[str, Callable[[], object]] = {
        "random": lambda: x.clone().bernoulli_(0.5),
        "clone": lambda: x.clone(),
        "transcendental": lambda: torch.tanh(x),
        "activation": lambda: nn.functional.gelu(x),
        "softmax": lambda: torch.softmax(square, -1),
        "norm": lambda: nn.functional.layer_norm(square, square.shape[-1:], weight, bias),
        "batch norm": lambda: nn.functional.batch_norm(images, *channels, training=True),
    }
    for kind, fn in ops.items():
        probes.add(("element", kind), fn)
    for name, dtype in DTYPES.items():
        s = torch.ones(1 << 14, dtype=dtype)
        probes.add(("add", name), lambda s=s: torch.add(s, s), 5)


def _elements(best: dict[Any, float]) -> tuple[dict[str, float], dict[str, float]]:
    element = {kind: t / ELEMENTS for (what, kind), t in ((k, v) for k, v in best.items() if k[0] == "element")}
    element["random"] -= element.pop("clone")  # the clone that keeps x as it was
    base = best[("add", "fp32")]
    convert = {name: max(best[("add", name)] - base, 0.0) / (1 << 14) for name in ("bf16", "fp16")}
    return element, convert


def _tiny_step() -> tuple[float, int, tuple[float, float]]:
    """Seconds and ops of one training step of a model whose tensors are tiny: forward, backward and an Adam-like
    update written as ``torch.optim``'s per-parameter loop writes it (an optimizer object would import TorchDynamo,
    seconds, where nothing imported it yet)."""
    from ...engine.torch_private import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(4)])
    params = list(model.parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    x = torch.randn(2, 8, generator=gen)

    def step() -> None:
        model(x).sum().backward()
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                g = p.grad
                p.mul_(1 - 1e-5)
                m.lerp_(g, 0.1)
                v.mul_(0.999).addcmul_(g, g, value=0.001)
                p.addcdiv_(m, (v / 0.999).sqrt().add_(1e-8), value=-1e-3)
        for p in params:
            p.grad = None

    step()
    t, c = time.perf_counter(), time.thread_time()
    with Count():
        step()
    counting = time.perf_counter() - t, time.thread_time() - c
    return _best(step, 5), Count.ops, counting


def measure_cpu() -> CpuProfile:
    """Time this CPU now (about a second and a half); see the module's documentation. The matmuls of fp16, which a
    CPU plan does not choose, are timed when an op first asks for them (:meth:`CpuProfile.gemm_fit`)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    probes = Probes()
    pool = torch.zeros(POOL // 4)
    with torch.no_grad():
        for name in HALF_TIMED:
            add_gemms(probes, name)
        # fp32 convolutions small and as large as a step's (oneDNN's rate grows with the work); the half types'
        # fallback is slow, and its rate does not grow
        conv_flops = {name: [(b, _add_conv(probes, name, b, size)) for b, size in CONV_SIZES[name]]
                      for name in HALF_TIMED}
        tiny_x, tiny_w = torch.randn(1, 4, 4, 4), torch.randn(4, 4, 3, 3)
        probes.add(("conv fixed",), lambda: torch.ops.aten.convolution(tiny_x, tiny_w, None, *_CONV_ARGS), 5)
        attention_flops = {name: _add_attention(probes, name) for name in HALF_TIMED}
        _add_memory(probes, pool)
        _add_elements(probes)
        best = probes.run()
        if _bf16_convs_fast(best, conv_flops):  # bf16 in hardware: timed at fp32's sizes too (see BF16_CONV_FAST)
            more = Probes()
            b, size = BF16_CONV_LARGE
            conv_flops["bf16"].append((b, _add_conv(more, "bf16", b, size)))
            add_gemms(more, "bf16", "fp32")
            best.update(more.run())
    del pool
    gemm = {name: gemm_fits(best, name) for name in HALF_TIMED}
    conv = {name: tuple((f, f / best[("conv", name, True, b)], 2 * f / best[("conv", name, False, b)])
                        for b, f in sizes) for name, sizes in conv_flops.items()}
    lengths = {name: tuple((float(n), f / best[("attention", name, True, n)], b / best[("attention", name, False, n)])
                           for n, (f, b) in sorted(by_length.items())) for name, by_length in attention_flops.items()}
    attention = {name: next((f, b) for n, f, b in pts if n == 128) for name, pts in lengths.items()}
    element, convert = _elements(best)
    step, ops, counting = _tiny_step()  # less the first count's import of sympy
    return CpuProfile(torch.get_num_threads(), gemm, conv, best[("conv fixed",)], attention, _memory(best), element,
                      convert, step / max(ops, 1), best[("dispatch",)] / LOOP, time.perf_counter() - t0 - counting[0],
                      time.thread_time() - c0 - counting[1], attention_lengths=lengths)


def _bf16_convs_fast(best: dict[Any, float], conv_flops: dict[str, list[tuple[int, float]]]) -> bool:
    """Whether the small bf16 convolution ran at least :data:`BF16_CONV_FAST` of the small fp32 one's rate."""
    (b16, f16), (b32, f32) = conv_flops["bf16"][0], conv_flops["fp32"][0]
    return f16 / best[("conv", "bf16", True, b16)] >= BF16_CONV_FAST * f32 / best[("conv", "fp32", True, b32)]


_PROFILES: dict[int, CpuProfile] = {}


def cpu_profile() -> CpuProfile:
    """This process's profile at the current thread count, measured on first use."""
    threads = torch.get_num_threads()
    if threads not in _PROFILES:
        _PROFILES[threads] = measure_cpu()
    return _PROFILES[threads]
