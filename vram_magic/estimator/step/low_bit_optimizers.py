"""The 8-bit, 4-bit, fp8 and paged optimizers of fine-tuning recipes (bitsandbytes' Adam family, torchao's low-bit
AdamW), modelled from shapes: neither library runs on fake tensors (bitsandbytes builds its code books with
``.tolist()``, and torchao's compiled update runs its kernel on the fake tensors' null pointers: the process dies), so
:class:`ModelledOptimizer` makes each parameter's state, with the shapes and dtypes the library gives it, as fake
tensors at the parameter's first step (where the library makes it), the step's temporaries for the target, and a row
per parameter in the op log for the time model (one pass of the fused update over what it reads and writes).

The formulas were read in, and checked to the byte against real CPU steps of, bitsandbytes 0.50.2 and torchao 0.18.0
with torch 2.13 (n = the parameter's elements, b = its bytes per element):

* bitsandbytes (``bitsandbytes/optim/optimizer.py``: ``init_state``, ``get_state_buffer``): with 8 bits and
  n ≥ ``min_8bit_size`` (4,096), ``state1``/``state2`` uint8 in the parameter's shape and ``absmax1``/``absmax2`` fp32
  of ⌈n/256⌉ blocks, plus two 256-value fp32 code books for the whole optimizer (2 KiB); otherwise two fp32 moments
  (8n, whatever the parameter's dtype). Paged optimizers on CUDA put ``state1``/``state2`` of parameters of ≥ 100,000
  elements in CUDA managed memory (``cudaMallocManaged``), which ``torch.cuda.memory_allocated`` does not count: those
  bytes are kept apart (:func:`paged_bytes`), never in the device's peak. The CUDA kernels update in place (no
  temporaries); the CPU kernels (``bitsandbytes/backends/cpu/ops.py``) make 20n (fp32 parameters) or 24n bytes
  (bf16/fp16) for 8 bits, 12n or 16n for 32 bits, plus 12 bytes of scalar wrappers.
* torchao (``torchao/optim/adam.py`` ``_new_buffer``; ``torchao/optim/subclass_8bit.py`` and its 4-bit and fp8
  twins): with n ≥ 4,096 and n a multiple of the block size (256; 128 for 4 bits), each moment is codes (uint8 n;
  4 bits: n/2; fp8: float8_e4m3fn n), an fp32 scale per block and a code book of its own (256 fp32; 4 bits: 16; fp8:
  none); otherwise each moment is ``zeros_like`` the parameter (its dtype). A 4-byte fp32 ``step`` counter on the host.
  The compiled update's buffers are what Inductor's C++ code allocates on the CPU (8-bit: 8n + 8n/bs; 4-bit:
  26n + 8n/bs; fp8: 8n/bs); for CUDA they stand in for Triton's, which were not measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...engine.phases import Phase
from ..options import RECIPE_OPTIMIZERS, OptimizerChoice, Options
from ..tracing.oplog import POINTWISE, OpLog, dtype_code

#: bitsandbytes' Adam-family classes (they keep the same state): their bits and paging by default
#: (bitsandbytes 0.50.2: bitsandbytes/optim/adamw.py, bitsandbytes/optim/adam.py; the ``8bit`` classes force 8
#: bits, the ``Paged`` ones paging)
BNB_CLASSES: dict[str, tuple[int, bool]] = {
    "Adam": (32, False), "AdamW": (32, False), "Adam32bit": (32, False), "AdamW32bit": (32, False),
    "Adam8bit": (8, False), "AdamW8bit": (8, False),
    "PagedAdam": (32, True), "PagedAdamW": (32, True), "PagedAdam32bit": (32, True), "PagedAdamW32bit": (32, True),
    "PagedAdam8bit": (8, True), "PagedAdamW8bit": (8, True),
}
#: torchao's low-bit Adam classes: their state's format and default block size (torchao 0.18.0: torchao/optim/adam.py)
TORCHAO_CLASSES: dict[str, tuple[str, int]] = {
    "AdamW8bit": ("8bit", 256), "Adam8bit": ("8bit", 256), "AdamW4bit": ("4bit", 128), "Adam4bit": ("4bit", 128),
    "AdamWFp8": ("fp8", 256), "AdamFp8": ("fp8", 256),
}
BNB_BLOCK = 256  # absmax blocks (bitsandbytes/optim/optimizer.py init_state: hard-coded)
BNB_PAGED_MIN = 100_000  # get_state_buffer: "p.numel() < 1e5" stays in PyTorch's allocator
AO_MIN = 4096  # torchao quantizes a moment of at least this many elements (torchao/optim/adam.py _new_buffer)
#: the state key under which a paged moment's bytes are kept (a number: CUDA managed memory is no tensor here)
PAGED_KEY = "paged (managed) bytes"
#: the scalar wrappers of a CPU step: an int64 and its fp32 cast (bitsandbytes' ``/ correction2``, torchao's
#: ``state["step"] += 1``), alive while the update's largest temporaries are
CPU_SCALARS = 12


@dataclass(frozen=True)
class Recipe:
    """What decides a library optimizer's state: the library and class, the state's format (``"8bit"``, ``"32bit"``,
    ``"4bit"``, ``"fp8"``), paging, bitsandbytes' smallest 8-bit tensor and per-parameter overrides (by the
    parameter's index), torchao's block size and amsgrad."""

    library: str
    cls: str
    kind: str
    paged: bool = False
    min_8bit_size: int = 4096
    block_size: int = 256
    amsgrad: bool = False
    max_unorm: float = 0.0
    overrides: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] = ()

    @property
    def title(self) -> str:
        return f"{_owner(self.library)} {self.cls}"


def _owner(library: str) -> str:
    """A library's name as a possessive: "bitsandbytes'", "torchao's"."""
    return f"{library}'" if library.endswith("s") else f"{library}'s"


def recipe_for(spec: Any) -> Recipe | None:
    """The :class:`Recipe` of an optimizer name, class or :class:`OptimizerChoice` of bitsandbytes or torchao; None for
    anything else (``TypeError`` for a class of theirs that is not modelled)."""
    if isinstance(spec, str):
        library, cls = RECIPE_OPTIMIZERS.get(spec, ("", ""))
        return _default_recipe(library, cls) if library in ("bitsandbytes", "torchao") else None
    cls = spec.cls if isinstance(spec, OptimizerChoice) else spec if isinstance(spec, type) else type(spec)
    library = str(getattr(cls, "__module__", "")).split(".")[0]
    if library not in ("bitsandbytes", "torchao"):
        return None
    recipe = _default_recipe(library, cls.__name__)
    if recipe is None:
        raise TypeError(f"{_owner(library)} {cls.__name__} is not modelled: the estimator models bitsandbytes' Adam "
                        f"family ({', '.join(BNB_CLASSES)}) and torchao's {', '.join(TORCHAO_CLASSES)}; pass one of "
                        "those or a name (adamw8bit, paged_adamw8bit, torchao_adamw4bit, ...)")
    if not isinstance(spec, OptimizerChoice):
        return recipe
    hyper = spec.defaults
    if library == "bitsandbytes":
        bits = hyper.get("optim_bits", 8 if recipe.kind == "8bit" else 32)
        return replace(recipe, kind="8bit" if bits == 8 else "32bit", paged=bool(hyper.get("is_paged", recipe.paged)),
                       min_8bit_size=int(hyper.get("min_8bit_size", recipe.min_8bit_size)),
                       max_unorm=float(hyper.get("max_unorm", 0.0) or 0.0),
                       overrides=tuple(hyper.get("overrides", ())))
    return replace(recipe, block_size=int(hyper.get("block_size", recipe.block_size)),
                   amsgrad=bool(hyper.get("amsgrad", False)))


def _default_recipe(library: str, cls: str) -> Recipe | None:
    if library == "bitsandbytes" and cls in BNB_CLASSES:
        bits, paged = BNB_CLASSES[cls]
        return Recipe(library, cls, "8bit" if bits == 8 else "32bit", paged=paged)
    if library == "torchao" and cls in TORCHAO_CLASSES:
        kind, block = TORCHAO_CLASSES[cls]
        return Recipe(library, cls, kind, block_size=block)
    return None


# --- the state and the temporaries of one parameter -----------------------------------------------------------------
def _bnb_config(recipe: Recipe, index: int) -> tuple[bool, float]:
    """``(8-bit, max_unorm)`` of the parameter at ``index`` (GlobalOptimManager's overrides win:
    bitsandbytes/optim/optimizer.py get_config)."""
    override = dict(dict(recipe.overrides).get(index, ()))
    bits = override.get("optim_bits", 8 if recipe.kind == "8bit" else 32)
    return bits == 8, float(override.get("max_unorm", recipe.max_unorm) or 0.0)


def quantized(recipe: Recipe, n: int, index: int = -1) -> bool:
    """Whether a parameter of ``n`` elements gets low-bit state."""
    if recipe.library == "bitsandbytes":
        eight, _ = _bnb_config(recipe, index)
        override = dict(dict(recipe.overrides).get(index, ()))
        return eight and n >= int(override.get("min_8bit_size", recipe.min_8bit_size))
    return n >= AO_MIN and n % recipe.block_size == 0


def state_specs(recipe: Recipe, p: torch.Tensor, index: int, target: str) -> list[tuple[str, tuple[int, ...],
                                                                                          torch.dtype, bool]]:
    """``[(key, shape, dtype, managed), ...]``: the tensors the library makes for ``p`` at its first step (the
    code books of bitsandbytes aside: :func:`code_books`); ``managed``: CUDA managed memory (paged)."""
    n, shape = p.numel(), tuple(p.shape)
    if recipe.library == "bitsandbytes":
        managed = recipe.paged and target == "cuda" and n >= BNB_PAGED_MIN  # a CPU parameter never pages
        if quantized(recipe, n, index):
            blocks = -(-n // BNB_BLOCK)
            out = [("state1", shape, torch.uint8, managed), ("state2", shape, torch.uint8, managed),
                   ("absmax1", (blocks,), torch.float32, False), ("absmax2", (blocks,), torch.float32, False)]
        else:
            out = [("state1", shape, torch.float32, managed), ("state2", shape, torch.float32, managed)]
        if _bnb_config(recipe, index)[1] > 0:
            out.append(("unorm_vec", (1,), torch.float32, False))
        return out
    out = [("step", (), torch.float32, False)]  # a host tensor, even for CUDA parameters
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if recipe.amsgrad else ())
    for key in moments:
        if not quantized(recipe, n):
            out.append((key, shape, p.dtype, False))
            continue
        blocks = n // recipe.block_size
        codes = (n // 2,) if recipe.kind == "4bit" else shape
        code_dtype = torch.float8_e4m3fn if recipe.kind == "fp8" else torch.uint8
        out += [(f"{key} codes", codes, code_dtype, False), (f"{key} scales", (blocks,), torch.float32, False)]
        if recipe.kind != "fp8":
            out.append((f"{key} code book", (16 if recipe.kind == "4bit" else 256,), torch.float32, False))
    return out


def code_books(recipe: Recipe) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    """bitsandbytes' two code books, shared by every 8-bit parameter (moved to the device at the first one)."""
    if recipe.library != "bitsandbytes":
        return []
    return [("qmap1", (256,), torch.float32, False), ("qmap2", (256,), torch.float32, False)]


def step_temporaries(recipe: Recipe, p: torch.Tensor, index: int, target: str) -> int:
    """Bytes the update of ``p`` allocates and frees on ``target``, at their most."""
    n = p.numel()
    if recipe.library == "bitsandbytes":
        if target == "cuda":
            return 0  # one fused kernel per parameter, in place (bitsandbytes/backends/cuda/ops.py)
        f = 4 * n
        copy = 0 if p.dtype == torch.float32 else f  # the fp32 copies of a bf16/fp16 parameter and gradient
        if quantized(recipe, n, index):  # both moments dequantized, the fp32 gradient, sqrt and quotient
            return 5 * f + copy + CPU_SCALARS
        return 3 * f + copy + CPU_SCALARS  # the fp32 gradient, then sqrt, "+ eps" and the quotient two at a time
    if not quantized(recipe, n):
        return 0 if target == "cuda" else CPU_SCALARS
    scales = 8 * (n // recipe.block_size)
    buffers = {"8bit": 8 * n + scales, "4bit": 26 * n + scales, "fp8": scales}[recipe.kind]
    return buffers if target == "cuda" else max(buffers, CPU_SCALARS)


def update_traffic(recipe: Recipe, p: torch.Tensor, index: int, target: str) -> int:
    """Bytes one fused pass of the update reads and writes: the parameter (read and written) and its gradient, and
    each moment read and written in its stored format."""
    state = sum(_numel(shape) * dtype.itemsize for key, shape, dtype, _ in state_specs(recipe, p, index, target)
                if key != "step")
    return 3 * p.numel() * p.element_size() + 2 * state


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- the optimizer that makes the state -----------------------------------------------------------------------------
class ModelledOptimizer(torch.optim.Optimizer):
    """A bitsandbytes or torchao optimizer as the estimator runs it on fake parameters: at each parameter's first step
    its state is made (:func:`state_specs`; paged moments kept as their bytes under :data:`PAGED_KEY`), then the
    update's temporaries are allocated and freed; ``ops``, when given the tracer's op log, gets one row per parameter
    updated. Parameters are updated one at a time, in order, as both libraries do."""

    def __init__(self, params: Iterable[Any], recipe: Recipe, target: str) -> None:
        super().__init__(params, {"lr": 1e-3})
        self.recipe, self.target = recipe, target
        self.ops: OpLog | None = None
        self._books: bool | None = None  # whether the code books were made (None: not yet looked at)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p  # a tensor-parallel shard: its own share
                state = self.state[p]
                if not state:
                    self._make_state(state, local, index)
                scratch = step_temporaries(self.recipe, local, index, self.target)
                if scratch:
                    temporary = torch.empty(scratch, dtype=torch.uint8)
                    del temporary
                if self.ops is not None:
                    self.ops.add(int(Phase.OPTIMIZER), POINTWISE, dtype_code(local.dtype), False, 0.0,
                                 float(update_traffic(self.recipe, local, index, self.target)), 0.0,
                                 float(local.numel()))

    def _make_state(self, state: dict[str, Any], p: torch.Tensor, index: int) -> None:
        recipe = self.recipe
        if recipe.library == "bitsandbytes":
            state["step"] = 0
            if quantized(recipe, p.numel(), index) and not self._has_books():
                for key, shape, dtype, _ in code_books(recipe):
                    state[key] = torch.empty(shape, dtype=dtype)
                self._books = True
        for key, shape, dtype, managed in state_specs(recipe, p, index, self.target):
            if managed:
                state[PAGED_KEY] = state.get(PAGED_KEY, 0) + _numel(shape) * dtype.itemsize
            else:
                state[key] = torch.zeros(shape, dtype=dtype)

    def _has_books(self) -> bool:
        if self._books is None:
            self._books = any("qmap1" in s for s in self.state.values())
        return self._books


def paged_bytes(optimizer: Any) -> int:
    """The bytes of an optimizer's state in CUDA managed memory (bitsandbytes' paged moments), which the device's
    allocated bytes do not count."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            total += int(state.get(PAGED_KEY, 0))
    return total


def paged_share(nbytes: int, opts: Options) -> int:
    """One rank's paged optimizer state: sharded with the rest of the state under ZeRO, none on the device when the
    state is offloaded to the host."""
    if opts.offload:
        return 0
    return -(-nbytes // opts.dp) if opts.zero else nbytes


def paged_note(nbytes: int) -> str:
    from ...core.units import format_bytes

    return (f"paged (managed) memory, not in the device's allocated bytes: {format_bytes(nbytes)} of optimizer state "
            "(bitsandbytes' paged moments of parameters of ≥ 100,000 elements) live in CUDA managed memory, outside "
            "PyTorch's allocator; they stay on the GPU while it has room and move to the host under pressure "
            "(est.paged; not in the peak or the fit)")


def recipe_note(recipe: Recipe, target: str) -> str:
    """What the estimate modelled of a library optimizer, and on which releases it was checked."""
    if recipe.library == "bitsandbytes":
        what = ("8-bit block-wise moments (uint8 + an fp32 absmax per 256 values; 32-bit under "
                f"{recipe.min_8bit_size:,} elements)" if recipe.kind == "8bit" else "32-bit moments")
        step = ("its CUDA kernels update in place (read in its source, not measured on a GPU)" if target == "cuda"
                else "its CPU kernels' fp32 temporaries")
        return (f"optimizer: {recipe.title}{' (paged)' if recipe.paged else ''} modelled from the parameters' shapes, "
                f"{what}; {step} (formulas checked against bitsandbytes 0.50.2 on torch 2.13)")
    kind = {"8bit": "8-bit", "4bit": "4-bit", "fp8": "fp8"}[recipe.kind]
    what = f"{kind} moments in blocks of {recipe.block_size} (full precision for tensors under 4,096 elements " \
           "or not a multiple of the block)"
    step = ("the compiled update's temporaries are Inductor's CPU buffers, taken for Triton's on CUDA (not measured on "
            "a GPU)" if target == "cuda" else "the compiled update's temporaries are Inductor's CPU buffers")
    return (f"optimizer: {recipe.title} modelled from the parameters' shapes, {what}; {step} (checked against torchao "
            "0.18.0 on torch 2.13)")


__all__ = ["BNB_CLASSES", "PAGED_KEY", "TORCHAO_CLASSES", "ModelledOptimizer", "Recipe", "code_books", "paged_bytes",
           "paged_note", "paged_share", "quantized", "recipe_for", "recipe_note", "state_specs", "step_temporaries",
           "update_traffic"]
