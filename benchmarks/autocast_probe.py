"""CUDA's autocast as the installed PyTorch runs it, against the estimator's model of it, op by op.

    python benchmarks/autocast_probe.py              # bf16 and fp16: one row per case, SAME / DIFFERENT / n/a
    python benchmarks/autocast_probe.py --dtype float16
    python benchmarks/autocast_probe.py --show NAME  # both sides' ops for one case

Every PyTorch build registers CUDA's autocast kernels (``AutocastCUDA``), CPU builds too, and fake tensors can say
they are on ``cuda:0`` without a GPU: one side runs each case on fake CUDA tensors under CUDA's autocast, through
PyTorch's own C++ kernels; the other runs it on fake CPU tensors under ``torch.autocast("cpu")`` with
``vram_magic.estimator.device.autocast.CudaAutocast`` registered (and, for SDPA, the CUDA attention model on a T4,
whose math kernel is what the fake CUDA dispatcher picks without a GPU; elsewhere the composites as PyTorch writes
them: the attention model's fused RMSNorm is another comparison). Each side records the ATen ops that reach
the fake tensors, with their inputs' and outputs' dtypes; the rows must be the same. No autograd on the CUDA side
(autograd's metadata asks a CUDA device guard, which a CPU build aborts on). A case whose CUDA side needs the driver
(cuDNN's convolutions on a CUDA build without a GPU) reads n/a. Each side runs in a subprocess of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"prim.device.default", "aten.detach.default"}
SDPA = "scaled_dot_product_attention (math)"
#: cases whose kernel after the casts depends on the build (CUDA builds run rms_norm as _fused_rms_norm on CUDA
#: tensors, a CPU build as the composite): compared on their casts and the output's dtype
CASTS_ONLY = {"rms_norm"}


def cases() -> dict:
    import torch
    from torch.nn import functional as F

    def t(*shape, dt="f"):
        return torch.empty(*shape, dtype={"f": torch.float32, "b": torch.bfloat16, "h": torch.float16}[dt])

    def ids():
        return torch.zeros(4, dtype=torch.long)

    out = {
        "linear": lambda lo: F.linear(t(4, 8, dt=lo), t(16, 8), t(16)),
        "matmul": lambda lo: torch.matmul(t(2, 4, 8), t(8, 6)),
        "bmm": lambda lo: torch.bmm(t(2, 4, 8), t(2, 8, 6)),
        "baddbmm": lambda lo: torch.baddbmm(t(2, 4, 6), t(2, 4, 8), t(2, 8, 6)),
        "addmm": lambda lo: torch.addmm(t(6), t(4, 8), t(8, 6)),
        "addmv": lambda lo: torch.addmv(t(4), t(4, 8), t(8)),
        "einsum": lambda lo: torch.einsum("ij,jk->ik", t(4, 8), t(8, 6)),
        "conv2d": lambda lo: F.conv2d(t(1, 3, 8, 8), t(4, 3, 3, 3), t(4)),
        "conv2d padding='same'": lambda lo: F.conv2d(t(1, 3, 8, 8), t(4, 3, 3, 3), t(4), padding="same"),
        "prelu": lambda lo: F.prelu(t(2, 4, dt=lo), t(4)),
        "layer_norm": lambda lo: F.layer_norm(t(4, 8, dt=lo), (8,), t(8), t(8)),
        "group_norm": lambda lo: F.group_norm(t(2, 4, 8, dt=lo), 2, t(4), t(4)),
        "rms_norm": lambda lo: F.rms_norm(t(4, 8, dt=lo), (8,), t(8)),
        "softmax": lambda lo: torch.softmax(t(4, 8, dt=lo), -1),
        "softmax of a product": lambda lo: torch.softmax(t(2, 4, 4, dt=lo) * 2, -1),
        "log_softmax": lambda lo: F.log_softmax(t(4, 8, dt=lo), -1),
        "softmax, dtype given": lambda lo: torch.softmax(t(4, 8, dt=lo), -1, dtype=torch.float64),
        "exp": lambda lo: torch.exp(t(4, 8, dt=lo)),
        "pow": lambda lo: t(4, 8, dt=lo) ** 3,
        "rsqrt": lambda lo: torch.rsqrt(t(4, 8, dt=lo)),
        "sum": lambda lo: t(4, 8, dt=lo).sum(),
        "sum over a dim": lambda lo: t(4, 8, dt=lo).sum(-1, keepdim=True),
        "mean": lambda lo: t(4, 8, dt=lo).mean(-1),
        "cumsum": lambda lo: torch.cumsum(t(4, 8, dt=lo), 1),
        "norm": lambda lo: torch.norm(t(4, 8, dt=lo)),
        "vector_norm": lambda lo: torch.linalg.vector_norm(t(4, 8, dt=lo), dim=-1),
        "cross_entropy": lambda lo: F.cross_entropy(t(4, 10, dt=lo), ids()),
        "nll_loss": lambda lo: F.nll_loss(t(4, 10, dt=lo), ids()),
        "mse_loss": lambda lo: F.mse_loss(t(4, 8, dt=lo), t(4, 8)),
        "binary_cross_entropy_with_logits": lambda lo: F.binary_cross_entropy_with_logits(t(4, 8, dt=lo), t(4, 8)),
        "binary_cross_entropy (banned)": lambda lo: F.binary_cross_entropy(t(4, 8, dt=lo), t(4, 8)),
        "addcmul (promote)": lambda lo: torch.addcmul(t(4, 8, dt=lo), t(4, 8), t(4, 8, dt=lo)),
        "atan2 (promote)": lambda lo: torch.atan2(t(4, dt=lo), t(4, dt=lo)),
        "cat": lambda lo: torch.cat([t(4, 8, dt=lo), t(4, 8)]),
        "stack": lambda lo: torch.stack([t(4, 8, dt=lo), t(4, 8)]),
        "gelu": lambda lo: F.gelu(t(4, 8, dt=lo)),
        "interpolate": lambda lo: F.interpolate(t(1, 2, 4, 4, dt=lo), scale_factor=2, mode="nearest"),
        "avg_pool3d": lambda lo: F.avg_pool3d(t(1, 2, 4, 4, 4, dt=lo), 2),
        # a head dim of 12: no fused kernel takes it on a T4 in either precision (the model's side), and the fake CUDA
        # dispatcher, with no GPU to ask, picks the math kernel too
        SDPA: lambda lo: F.scaled_dot_product_attention(t(1, 2, 4, 12), t(1, 2, 4, 12), t(1, 2, 4, 12, dt=lo)),
    }
    if hasattr(torch.linalg, "matrix_sqrth"):
        out["linalg.matrix_sqrth"] = lambda lo: torch.linalg.matrix_sqrth(t(4, 4, dt=lo))
    return out


def side(which: str, dtype_names: list[str]) -> dict[str, dict[str, list[str]]]:
    """One side's ops per dtype and case: ``"cuda"`` (PyTorch's own kernels) or ``"model"``."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if str(func) not in SKIP:
                flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
                ins = ",".join(str(a.dtype)[6:] for a in flat if isinstance(a, torch.Tensor))
                outs = ",".join(str(o.dtype)[6:] for o in (out if isinstance(out, (tuple, list)) else [out])
                                if isinstance(o, torch.Tensor))
                self.rows.append(f"{func} {ins} -> {outs}")
            return out

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stack = contextlib.ExitStack()
    if which == "cuda":
        torch.set_default_device("cuda:0")
        torch.set_autocast_enabled("cuda", True)
    else:
        sys.path.insert(0, ROOT)
        from vram_magic.estimator.device.autocast import CudaAutocast, CudaAutocastMode
        from vram_magic.estimator.device.sdpa import CudaAttention, CudaKernelMode

        autocast = stack.enter_context(CudaAutocast())

    def region(dtype, name):  # type: ignore[no-untyped-def]
        inner = contextlib.ExitStack()
        if which == "cuda":
            torch.set_autocast_dtype("cuda", dtype)
            return inner
        inner.enter_context(torch.autocast("cpu", dtype=dtype))
        if name == SDPA:  # the kernel choice is the attention model's; elsewhere the composites as they are
            inner.enter_context(CudaKernelMode(CudaAttention((7, 5))))
        inner.enter_context(CudaAutocastMode(autocast))
        return inner

    found: dict[str, dict[str, list[str]]] = {}
    with stack:
        for dtype_name in dtype_names:
            lower = {"bfloat16": "b", "float16": "h"}[dtype_name]
            rows = found[dtype_name] = {}
            for name, case in cases().items():
                log = Log()
                try:
                    with torch.no_grad(), mode, log, region(getattr(torch, dtype_name), name):
                        case(lower)
                    rows[name] = log.rows
                except Exception as err:  # what the op raised is part of what is compared (the banned one)
                    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    gpu = which == "cuda" and ("CUDA driver" in text or "no CUDA GPUs" in text or "cuDNN" in text)
                    rows[name] = ["n/a: " + text[:80]] if gpu else [f"error {type(err).__name__}: {text[:80]}"]
    return found


def compare(dtype_names: list[str], python: str = sys.executable) -> dict[tuple[str, str], tuple[list[str], list[str]]]:
    """``{(dtype, case): (PyTorch's CUDA ops, the model's ops)}`` for autocast to each of ``dtype_names``."""
    got = {}
    for which in ("cuda", "model"):
        done = subprocess.run([python, os.path.abspath(__file__), "--side", which, "--dtype", *dtype_names],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"the {which} side failed: {done.stderr.strip()[-2000:]}")
        got[which] = json.loads(done.stdout.strip().splitlines()[-1])
    pairs = {(d, name): (got["cuda"][d][name], got["model"][d][name]) for d in dtype_names for name in got["cuda"][d]}
    for key, (cuda, model) in pairs.items():
        if key[1] in CASTS_ONLY:
            pairs[key] = (_casts(cuda), _casts(model))
    return pairs


def _casts(rows: list[str]) -> list[str]:
    """A case's casts (``_to_copy`` rows) and the dtype it ends in."""
    if not rows or " -> " not in rows[-1]:
        return rows
    return [r for r in rows if r.startswith("aten._to_copy")] + ["ends in " + rows[-1].split(" -> ")[-1].split(",")[0]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=("cuda", "model"), help=argparse.SUPPRESS)
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16"))
    p.add_argument("--show", metavar="CASE", help="print both sides' ops for this case")
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(side(args.side, args.dtype)))
        return 0
    import torch

    print(f"torch {torch.__version__}: CUDA's autocast kernels vs the model, op by op")
    different = 0
    for (dtype_name, name), (cuda, model) in compare(args.dtype).items():
        if args.show and name != args.show:
            continue
        verdict = "n/a" if cuda and cuda[0].startswith("n/a") else "SAME" if cuda == model else "DIFFERENT"
        different += verdict == "DIFFERENT"
        print(f"  {dtype_name:8}  {name:38}  {verdict}")
        if args.show or verdict == "DIFFERENT":
            print("      CUDA : " + "\n             ".join(cuda))
            print("      model: " + "\n             ".join(model))
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
