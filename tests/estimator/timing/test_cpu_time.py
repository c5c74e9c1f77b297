"""The time model on the CPU: each op of the op log timed from a profile by hand-worked formulas (a matmul by the
fitted GEMM model of its dtype, layout and shape; a convolution by its FLOPs at its direction's rate; any other op by
its bytes or, for the kinds that compute more than they move, its elements), the GEMM fit itself, the op log's rows
of real ops, and a real MLP's traced step whose matmul seconds are its FLOPs worked out from its layers' sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import vram_magic
from vram_magic.engine.phases import Phase
from vram_magic.estimator.timing import cost
from vram_magic.estimator.timing.cpu_gemm import KNOTS, GemmFit, features, fit_gemm, nonnegative_fit
from vram_magic.estimator.timing.cpu_profile import CpuProfile
from vram_magic.estimator.timing.rates import cpu_op_time, cpu_rates
from vram_magic.estimator.tracing.oplog import (
    ACTIVATION,
    BATCH_NORM,
    CONV,
    LAYOUTS,
    MATMUL,
    POINTWISE,
    SOFTMAX,
    VIEW,
    OpLog,
    gemm_shape,
    op_traits,
)

FORWARD, BACKWARD, OPTIMIZER = int(Phase.FORWARD), int(Phase.BACKWARD), int(Phase.OPTIMIZER)
NN, NT, TN = (LAYOUTS.index(x) for x in ("NN", "NT", "TN"))
# seconds: fixed, per result element, per operand element, per multiply-add at n = 64, 256, 1024, 2048, per
# multiply-add and doubling of k beyond 256 (none here; test_a_long_inner_dimension_adds_its_own_cost)
COEF = (1e-5, 1e-9, 2e-10, 4e-11, 3e-11, 2e-11, 1e-11, 0.0)


def profile(**changes) -> CpuProfile:
    """A profile whose every figure is round: GEMMs by :data:`COEF` (bf16 ten times slower, and NN another 2×),
    convolutions at 10/5 GFLOP/s forward/backward plus 20 µs, memory 1e-10 s/B moved and 2e-10 s/B allocated at
    100 kB, 5e-11 and 1e-10 at 10 MB; activations 2 ns per element, batch norm 3 ns; bf16 1 ns per element more;
    1 µs per op."""
    slow = tuple(c * 10 for c in COEF)
    fields = dict(
        threads=1,
        gemm={"fp32": {lay: GemmFit(COEF) for lay in ("NN", "NT", "TN")},
              "bf16": {"NN": GemmFit(tuple(c * 2 for c in slow)), "NT": GemmFit(slow), "TN": GemmFit(slow)}},
        conv={"fp32": ((1e8, 10e9, 5e9),)}, conv_fixed=20e-6, attention={"fp32": (20e9, 10e9)},
        memory=((1e5, 1e-10, 2e-10), (1e7, 5e-11, 1e-10)),
        element={"activation": 2e-9, "batch norm": 3e-9}, convert={"bf16": 1e-9}, op_overhead=1e-6, dispatch=1e-6)
    fields.update(changes)
    return CpuProfile(**fields)


# --- one op's seconds --------------------------------------------------------------------------------------------
def test_a_matmul_row_is_the_overhead_plus_the_fitted_gemm_of_its_shape():
    t = cpu_op_time(profile())
    # (32, 256) @ (256, 1024): 1e-5 fixed + 32·1024 results · 1e-9 + (32·256 + 256·1024) operands · 2e-10
    # + 32·1024·256 FLOP pairs at n = 1024's 2e-11, + 1 µs per op
    by_hand = 1e-5 + 32768 * 1e-9 + 270336 * 2e-10 + 8388608 * 2e-11 + 1e-6
    assert t(FORWARD, MATMUL, 0, 0, 2 * 8388608, 0, 0, 0, (1, 32, 1024, 256, NT)) == pytest.approx(by_hand)
    # a batch of 4: one fixed cost, four bodies
    four = 1e-5 + 4 * (32768 * 1e-9 + 270336 * 2e-10 + 8388608 * 2e-11) + 1e-6
    assert t(FORWARD, MATMUL, 0, 0, 0, 0, 0, 0, (4, 32, 1024, 256, NN)) == pytest.approx(four)
    # n = 512 lies halfway (in log2) between the knots 256 and 1024: (3e-11 + 2e-11) / 2 per FLOP pair
    half = 1e-5 + 32 * 512 * 1e-9 + (32 * 256 + 256 * 512) * 2e-10 + 32 * 512 * 256 * 2.5e-11 + 1e-6
    assert t(FORWARD, MATMUL, 0, 0, 0, 0, 0, 0, (1, 32, 512, 256, NT)) == pytest.approx(half)
    # bf16 by its own fit, which differs by layout: NN twice NT
    bf16_nt = t(FORWARD, MATMUL, 1, 0, 0, 0, 0, 0, (1, 32, 1024, 256, NT))
    bf16_nn = t(FORWARD, MATMUL, 1, 0, 0, 0, 0, 0, (1, 32, 1024, 256, NN))
    assert bf16_nt == pytest.approx(10 * (by_hand - 1e-6) + 1e-6)
    assert bf16_nn - 1e-6 == pytest.approx(2 * (bf16_nt - 1e-6))


def test_a_matmul_of_unknown_shape_runs_at_a_square_gemms_rate():
    t = cpu_op_time(profile())
    square = 1e-5 + 512**2 * 1e-9 + 2 * 512**2 * 2e-10 + 512**3 * 2.5e-11  # n = 512: between 256 and 1024
    assert t(FORWARD, MATMUL, 0, 0, 1e9, 0, 0, 0, None) == pytest.approx(1e-6 + 1e9 * square / (2 * 512**3))


def test_a_pointwise_row_is_timed_by_its_bytes_moved_and_allocated():
    t = cpu_op_time(profile())
    # 100 kB moved, 40 kB of them a fresh result: 1e5 · 1e-10 + 4e4 · 2e-10, + 1 µs
    assert t(FORWARD, POINTWISE, 0, 0, 0, 1e5, 4e4, 1e4, None) == pytest.approx(1e-5 + 8e-6 + 1e-6)
    # 1 MB lies halfway (in log size) between 100 kB and 10 MB: 7.5e-11 and 1.5e-10 per byte
    assert t(FORWARD, POINTWISE, 0, 0, 0, 1e6, 0, 0, None) == pytest.approx(1e6 * 7.5e-11 + 1e-6)
    assert t(FORWARD, POINTWISE, 0, 0, 0, 1e6, 1e6, 0, None) == pytest.approx(1e6 * (7.5e-11 + 1.5e-10) + 1e-6)
    # beyond the sizes timed: the largest's rates
    assert t(FORWARD, POINTWISE, 0, 0, 0, 1e9, 0, 0, None) == pytest.approx(1e9 * 5e-11 + 1e-6)
    # a view moves nothing: its cost per op only
    assert t(FORWARD, VIEW, 0, 0, 0, 1e9, 1e9, 1e9, None) == pytest.approx(1e-6)


def test_an_op_that_computes_more_than_it_moves_is_timed_by_its_elements():
    t = cpu_op_time(profile())
    # GELU of 1e6 fp32 elements, 8 MB moved: its bytes say 8e6 · 5.2e-11 ≈ 0.4 ms, its elements 1e6 · 2 ns = 2 ms
    assert t(FORWARD, ACTIVATION, 0, 0, 0, 8e6, 0, 1e6, None) == pytest.approx(2e-3 + 1e-6)
    # in bf16 each element costs 1 ns more (converted to fp32 and back)
    assert t(FORWARD, ACTIVATION, 1, 0, 0, 4e6, 0, 1e6, None) == pytest.approx(3e-3 + 1e-6)
    # a plain add in bf16: its conversion only, when that is more than its bytes
    assert t(FORWARD, POINTWISE, 1, 0, 0, 6e3, 0, 1e6, None) == pytest.approx(1e-3 + 1e-6)
    # batch norm by its own rate
    assert t(FORWARD, BATCH_NORM, 0, 0, 0, 8e6, 0, 1e6, None) == pytest.approx(3e-3 + 1e-6)
    # an element-bound kind the profile has no rate for falls back to its bytes
    assert t(FORWARD, SOFTMAX, 0, 0, 0, 1e5, 0, 1e9, None) == pytest.approx(1e-5 + 1e-6)


def test_a_convolution_runs_at_its_directions_rate_and_a_recompute_at_the_forwards():
    t = cpu_op_time(profile())
    assert t(FORWARD, CONV, 0, 0, 1e9, 0, 0, 0, None) == pytest.approx(1e-6 + 0.1 + 20e-6)
    assert t(BACKWARD, CONV, 0, 0, 1e9, 0, 0, 0, None) == pytest.approx(1e-6 + 0.2 + 20e-6)
    assert t(BACKWARD, CONV, 0, 1, 1e9, 0, 0, 0, None) == pytest.approx(1e-6 + 0.1 + 20e-6)  # checkpoint's forward
    # bf16 with no rate of its own: fp32's
    assert t(FORWARD, CONV, 1, 0, 1e9, 0, 0, 0, None) == pytest.approx(1e-6 + 0.1 + 20e-6)
    # timed at two sizes: the rate interpolated in log FLOPs between them (a backward's size is half its FLOPs)
    two = cpu_op_time(profile(conv={"fp32": ((1e7, 1e9, 1e9), (1e9, 100e9, 10e9))}))
    assert two(FORWARD, CONV, 0, 0, 1e8, 0, 0, 0, None) == pytest.approx(1e-6 + 1e8 / 10e9 + 20e-6)
    assert two(BACKWARD, CONV, 0, 0, 2e8, 0, 0, 0, None) == pytest.approx(1e-6 + 2e8 / 10**9.5 + 20e-6)
    assert two(FORWARD, CONV, 0, 0, 1e11, 0, 0, 0, None) == pytest.approx(1e-6 + 1e11 / 100e9 + 20e-6)


def test_time_ops_sorts_the_cpu_rows_into_compute_memory_recompute_and_optimizer():
    log = OpLog()
    log.add(FORWARD, MATMUL, 0, False, 0, 0, shape=(1, 32, 1024, 256, NT))
    log.add(FORWARD, POINTWISE, 0, False, 0, 1e5, 4e4, 1e4)
    log.add(BACKWARD, CONV, 0, True, 1e9, 0)
    log.add(BACKWARD, VIEW, 0, False, 0, 0)
    log.add(OPTIMIZER, POINTWISE, 0, False, 0, 1e7, 0, 0)
    t = cost.time_ops(log, cpu_rates(profile()))
    mm = 1e-5 + 32768 * 1e-9 + 270336 * 2e-10 + 8388608 * 2e-11 + 1e-6
    assert t.compute == pytest.approx(mm)
    assert t.memory == pytest.approx(1e-5 + 8e-6 + 1e-6 + 1e-6)  # the add and the view
    assert t.recompute == pytest.approx(1e-6 + 0.1 + 20e-6)
    assert t.optimizer == pytest.approx(1e7 * 5e-11 + 1e-6) and t.ops == 5
    assert cost.time_ops(log, cpu_rates(profile()), start=2, end=4).recompute == pytest.approx(t.recompute)
    assert cost.time_ops(log, cpu_rates(profile()), start=2, end=4).ops == 2


# --- the GEMM model --------------------------------------------------------------------------------------------
def test_the_gemm_fit_recovers_the_coefficients_it_was_made_from():
    truth = GemmFit(COEF)
    shapes = [(64, 512, 64), (64, 512, 256), (64, 512, 1024), (64, 512, 2048), (512, 128, 64), (512, 128, 2048),
              (64, 2048, 256), (512, 64, 1024), (2048, 64, 256), (8, 64, 64), (300, 100, 700), (16, 1024, 512)]
    fit = fit_gemm([(m, n, k, truth.seconds(m, n, k)) for m, k, n in shapes])
    assert fit.worst < 1e-9
    assert fit.coef == pytest.approx(COEF, rel=1e-6)
    # the cost per FLOP pair is linear in log2 n between the knots, flat beyond them
    assert features(1, KNOTS[0] // 2, 1)[3:7] == [KNOTS[0] // 2, 0, 0, 0]
    assert features(1, 4 * KNOTS[-1], 1)[3:7] == [0, 0, 0, 4 * KNOTS[-1]]
    assert features(1, 2 * KNOTS[0], 1)[3:7] == [KNOTS[0], KNOTS[0], 0, 0]  # halfway (in log2) from 256 to 1024


def test_a_long_inner_dimension_adds_its_own_cost():
    # 4e-12 s per multiply-add and doubling of k beyond 256: k = 1024 is two doublings
    fit = GemmFit((0.0, 0.0, 0.0, 1e-11, 1e-11, 1e-11, 1e-11, 4e-12))
    assert fit.seconds(8, 64, 256) == pytest.approx(8 * 64 * 256 * 1e-11)
    assert fit.seconds(8, 64, 1024) == pytest.approx(8 * 64 * 1024 * (1e-11 + 2 * 4e-12))
    assert fit.seconds(8, 64, 100) == pytest.approx(8 * 64 * 100 * 1e-11)  # shorter: no extra


def test_a_term_fitted_negative_is_dropped():
    # times = 2·x0 exactly, x1's column anti-correlated noise: unconstrained least squares gives x1 < 0
    rows = [[1.0, 1.0], [2.0, 0.5], [3.0, 0.1], [4.0, 0.0]]
    times = [2.0 - 0.3, 4.0 - 0.15, 6.0 - 0.03, 8.0]
    x = nonnegative_fit(rows, times)
    assert x[1] == 0.0
    # then x0 alone, in relative error: minimise Σ (r·x0/t − 1)², so x0 = Σ(r/t) / Σ(r/t)²
    q = [r[0] / t for r, t in zip(rows, times)]
    assert x[0] == pytest.approx(sum(q) / sum(v * v for v in q))


# --- the op log's rows of real ops --------------------------------------------------------------------------------
def record(func, *args, **kwargs) -> OpLog:
    out = func(*args, **kwargs)
    log = OpLog()
    log.record(op_traits(func, False), func.overloadpacket.__name__, FORWARD, False, 0, args, kwargs, out)
    return log


def test_the_op_log_counts_bytes_moved_allocated_and_elements_of_real_ops():
    a, b = torch.ones(1024), torch.ones(1024)
    add = record(torch.ops.aten.add.Tensor, a, b)  # reads 2 × 4 KiB, writes a fresh 4 KiB
    assert (add.bytes[0], add.fresh[0], add.elements[0]) == (3 * 4096, 4096, 1024)
    inplace = record(torch.ops.aten.add_.Tensor, a, b)  # writes into a: nothing allocated
    assert (inplace.bytes[0], inplace.fresh[0]) == (3 * 4096, 0)
    fill = record(torch.ops.aten.fill_.Scalar, a, 0.0)  # only writes
    assert (fill.bytes[0], fill.fresh[0]) == (4096, 0)
    half = torch.ones(1024, dtype=torch.bfloat16)
    copy = record(torch.ops.aten.copy_.default, half, a)  # reads 4 KiB of fp32, writes 2 KiB of bf16
    assert (copy.bytes[0], copy.fresh[0], copy.dtype[0]) == (4096 + 2048, 0, 1)
    gelu = record(torch.ops.aten.gelu.default, a)
    assert gelu.kind[0] == ACTIVATION and gelu.elements[0] == 1024


def test_a_matmuls_shape_and_layout_are_read_from_its_operands_strides():
    x, w = torch.ones(32, 256), torch.ones(1024, 256)
    assert gemm_shape((x, w.t())) == (1, 32, 1024, 256, NT)  # a Linear's forward: x @ Wᵀ
    g = torch.ones(32, 1024)
    assert gemm_shape((g, w)) == (1, 32, 256, 1024, NN)  # its input's gradient: g @ W
    assert gemm_shape((g.t(), x)) == (1, 1024, 256, 32, TN)  # its weight's gradient: gᵀ @ x
    assert gemm_shape((torch.ones(4, 8, 16), torch.ones(4, 16, 2))) == (4, 8, 2, 16, NN)
    row = record(torch.ops.aten.addmm.default, torch.zeros(1024), x, w.t())
    assert row.kind[0] == MATMUL and row.shapes[row.shape[0]] == (1, 32, 1024, 256, NT)


# --- a real model's step --------------------------------------------------------------------------------------
def test_a_real_mlps_matmul_seconds_are_its_flops_worked_out_from_its_layers():
    """Only multiply-adds cost (2e-11 s per FLOP pair at every row length, nothing else): the step's compute is
    the MLP's matmul FLOPs, worked out from its sizes, whatever the trace's op count, shapes or layouts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    batch = 32
    flat = GemmFit((0.0, 0.0, 0.0, 2e-11, 2e-11, 2e-11, 2e-11, 0.0))
    p = profile(gemm={"fp32": {lay: flat for lay in ("NN", "NT", "TN")}}, op_overhead=0.0,
                memory=((1e5, 1e-30, 0.0), (1e7, 1e-30, 0.0)), element={}, convert={})
    est = vram_magic.estimate(model, torch.randn(batch, 256), device="cpu")
    trace = est.rerun.trace(est.options)
    t = cost.time_ops(trace.ops, cpu_rates(p), trace.ops_start)
    weights = 256 * 1024 * 2
    # the forward and the weight's gradient of both layers, the input's gradient of the second only (the batch
    # needs none): five products of batch × 256 × 1024 multiply-adds
    pairs = batch * (3 * 256 * 1024 + 2 * 1024 * 256)
    assert pairs == batch * weights * 5 // 2
    assert t.compute == pytest.approx(pairs * 2e-11, rel=1e-9)
    assert t.memory == pytest.approx(0.0, abs=1e-12) and t.recompute == 0.0 and math.isfinite(t.optimizer)


# --- the CPU's flash attention ----------------------------------------------------------------------------------------
def test_attention_runs_at_the_rate_of_its_length_and_a_causal_mask_computes_whole_key_blocks():
    from vram_magic.estimator.timing.rates import cpu_attention_work
    from vram_magic.estimator.tracing.oplog import ATTENTION

    # timed at 64 and 1,024 tokens: forward 10 and 160 GFLOP/s, backward 5 and 80
    p = profile(attention={"fp32": (20e9, 10e9)},
                attention_lengths={"fp32": ((64.0, 10e9, 5e9), (1024.0, 160e9, 80e9))})
    t = cpu_op_time(p)
    # 256 tokens lie halfway in log between 64 and 1,024: 40 GFLOP/s forward (geometric mean), 20 backward
    assert t(FORWARD, ATTENTION, 0, 0, 4e9, 0, 0, 0, (64, 256, 256, 64, 0)) == pytest.approx(1e-6 + 0.1)
    assert t(BACKWARD, ATTENTION, 0, 0, 4e9, 0, 0, 0, (64, 256, 256, 64, 0)) == pytest.approx(1e-6 + 0.2)
    # shorter and longer than the lengths timed: the ends' rates; a query length of 16 over 1,024 keys is 128 tokens
    assert t(FORWARD, ATTENTION, 0, 0, 1e9, 0, 0, 0, (4, 32, 32, 64, 0)) == pytest.approx(1e-6 + 0.1)
    assert t(FORWARD, ATTENTION, 0, 0, 16e9, 0, 0, 0, (4, 4096, 4096, 64, 0)) == pytest.approx(1e-6 + 0.1)
    rate_128 = 10e9 * 16 ** 0.25  # a quarter of the way from 64 to 1,024 in log
    assert t(FORWARD, ATTENTION, 0, 0, 1e9, 0, 0, 0, (4, 16, 1024, 64, 0)) == pytest.approx(1e-6 + 1e9 / rate_128)
    # unknown length (another kernel): the rate at 128 tokens the profile keeps
    assert t(FORWARD, ATTENTION, 0, 0, 2e9, 0, 0, 0, None) == pytest.approx(1e-6 + 0.1)
    # a causal mask: the FLOPs counted are half the full ones, but keys within one block of 512 are all computed
    # (twice the counted), and of 2 blocks three quarters of the full work, of 4 blocks five eighths
    assert cpu_attention_work(256, False) == 1.0
    assert cpu_attention_work(512, True) == 2.0
    assert cpu_attention_work(1024, True) == pytest.approx(1.5)
    assert cpu_attention_work(2048, True) == pytest.approx(1.25)
    assert t(FORWARD, ATTENTION, 0, 0, 1e9, 0, 0, 0, (4, 1024, 1024, 64, 1)) == pytest.approx(1e-6 + 1.5e9 / 160e9)
    # bf16 with no rates of its own: fp32's
    assert t(FORWARD, ATTENTION, 1, 0, 4e9, 0, 0, 0, (64, 256, 256, 64, 0)) == pytest.approx(1e-6 + 0.1)


def test_the_op_log_keeps_the_cpu_attentions_lengths_and_mask():
    from vram_magic.estimator.tracing.oplog import ATTENTION, cpu_attention_shape

    q, k = torch.randn(2, 4, 96, 32), torch.randn(2, 4, 160, 32)
    fwd = "_scaled_dot_product_flash_attention_for_cpu"
    assert cpu_attention_shape(fwd, (q, k, k, 0.0, True), {}) == (8, 96, 160, 32, 1)
    assert cpu_attention_shape(fwd, (q, k, k), {"is_causal": False}) == (8, 96, 160, 32, 0)
    out = torch.randn(2, 4, 96, 32)
    assert cpu_attention_shape(fwd + "_backward", (out, q, k, k, out, torch.randn(2, 4, 96), 0.0, True), {}) == \
        (8, 96, 160, 32, 1)
    assert cpu_attention_shape("_efficient_attention_forward", (q, k, k), {}) is None
    # a real attention's row, through the op log
    log = OpLog()
    q = torch.randn(1, 2, 64, 16)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out = op(q, q, q, 0.0, True)
    log.record(op_traits(op, ()), op.__name__, FORWARD, False, 0, (q, q, q, 0.0, True), {}, out)
    (row,) = list(log.rows_full())
    assert row[1] == ATTENTION and row[8] == (2, 64, 64, 16, 1)
    assert row[4] == 4 * 2 * 64 * 64 * 16 // 2  # the counted FLOPs: half of QKᵀ and PV's under the causal mask


def test_bf16_is_timed_at_fp32s_sizes_only_where_its_small_convolution_runs_near_fp32s_rate():
    from vram_magic.estimator.timing.cpu_profile import _bf16_convs_fast

    flops = {"fp32": [(2, 38e6)], "bf16": [(4, 19e6)]}
    fp32 = {("conv", "fp32", True, 2): 38e6 / 90e9}
    assert _bf16_convs_fast({**fp32, ("conv", "bf16", True, 4): 19e6 / 114e9}, flops)  # AVX-512 BF16: faster
    assert _bf16_convs_fast({**fp32, ("conv", "bf16", True, 4): 19e6 / 45e9}, flops)  # half fp32's rate
    assert not _bf16_convs_fast({**fp32, ("conv", "bf16", True, 4): 19e6 / 8e9}, flops)  # a fallback kernel
