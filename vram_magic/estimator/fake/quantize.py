"""Quantized weights on fake tensors: each format counted from its own layout, each library's matmul mirrored.

``estimate(..., quantize="nf4")`` replaces the model's linear layers (all but the output head, which
transformers and bitsandbytes keep in the model's dtype) by :class:`QuantLinear` stand-ins holding exactly the
bytes of the format — the packed weights and their constants, as frozen parameters — and allocating what the
library's matmul allocates. A model that is already quantized (``torch.ao`` dynamic quantization, torchao's
``Int8Tensor``, bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``) is estimated as it is: each quantized layer
is copied as a stand-in with the same tensors (shapes and dtypes read from the layer) and the same matmul.

What each library's matmul allocates (the memory a GPU's allocator or PyTorch's profiler sees):

* ``dequant`` (bitsandbytes' 4-bit layers in training and for inputs of many rows; bitsandbytes' int8 on the
  CPU; the ``quantize=`` formats): the weight is dequantized into a temporary of the compute dtype for each
  matmul, in the forward and again in the backward (never saved for backward). With double quantization the
  block constants are dequantized first (an fp32 temporary per block).
* ``ao-int8`` (torchao's ``Int8Tensor``): the transposed weight converted to the compute dtype, a matmul, the
  per-row scale applied as a new tensor, the bias added in place; autograd saves the converted weight.
* ``fbgemm`` (``torch.ao``'s ``quantized::linear_dynamic``): inside the op an int32 accumulator of the output's
  shape, then the output.
* ``bnb-cpu`` (bitsandbytes' 4-bit inference once the CPU has repacked the weight): inside the op a bf16 copy of
  the input and a bf16 result, then the output in the input's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..options import QUANTIZE_FORMATS, parse_quantize


@dataclass(frozen=True)
class QuantFormat:
    """A weight format: the bytes it stores per weight and per block (or row) of weights."""

    name: str
    bits: int  # per weight
    block: int  # weights per block of constants along the input dimension; 0: one set per output row
    label: str  # what it is, as the estimate names it
    library: str

    def parts(self, out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """``[(name, shape, dtype, role)]``: the tensors a layer of this shape holds (role ``"data"`` or
        ``"constants"``)."""
        n = out_features * in_features
        data = ("weight", (-(-n * self.bits // 8),), torch.uint8 if self.bits == 4 else torch.int8, "data")
        if self.name == "int8":  # bitsandbytes' Int8Params: an fp32 scale (SCB) per output row
            return [data, ("SCB", (out_features,), torch.float32, "constants")]
        if self.name == "int4":  # torchao's int4 weight-only (tinygemm): a bf16 scale and zero point per group
            groups = -(-in_features // self.block)
            return [data, ("scales_and_zeros", (groups, out_features, 2), torch.bfloat16, "constants")]
        blocks = -(-n // self.block)  # bitsandbytes NF4: an absmax per block of 64, the 16-value code book
        if self.name == "nf4":
            return [data, ("absmax", (blocks,), torch.float32, "constants"),
                    ("code", (16,), torch.float32, "constants")]
        # double quantization: absmax as 8-bit codes, an fp32 absmax per 256 of them, their mean (offset), and the
        # 8-bit code book they index (256 fp32 values, one per layer)
        return [data, ("absmax", (blocks,), torch.uint8, "constants"),
                ("absmax2", (-(-blocks // 256),), torch.float32, "constants"),
                ("offset", (), torch.float32, "constants"), ("code", (16,), torch.float32, "constants"),
                ("code2", (256,), torch.float32, "constants")]

    def layer_bytes(self, out_features: int, in_features: int) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                   for _, shape, dt, _ in self.parts(out_features, in_features))

    @property
    def nested(self) -> bool:
        return self.name == "nf4-dq"


FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", 8, 0, "int8, an fp32 scale per output row (bitsandbytes LLM.int8 layout)",
                        "bitsandbytes"),
    "int4": QuantFormat("int4", 4, 128, "int4 in groups of 128, a bf16 scale and zero point per group (torchao "
                        "int4 weight-only layout)", "torchao"),
    "nf4": QuantFormat("nf4", 4, 64, "nf4 in blocks of 64, an fp32 absmax per block (bitsandbytes, single "
                       "quantization)", "bitsandbytes"),
    "nf4-dq": QuantFormat("nf4-dq", 4, 64, "nf4 in blocks of 64, absmax double-quantized to 8 bits with an fp32 "
                          "absmax per 256 blocks (bitsandbytes, QLoRA's double quantization)", "bitsandbytes"),
}
assert tuple(FORMATS) == QUANTIZE_FORMATS, "options.QUANTIZE_FORMATS names the formats laid out here"


class NotApplicable(ValueError):
    """``quantize=`` or ``lora=`` on a model with no linear layer: nothing to quantize or adapt (a what-if row
    that does not apply is left out)."""


def features(m: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer: ``nn.Linear``, a stand-in, or transformers' ``Conv1D``
    (GPT-2's linear layers, weight stored as ``(in, out)``); ``None`` for anything else."""
    if isinstance(m, (nn.Linear, QuantLinear)):
        return m.in_features, m.out_features
    if type(m).__name__ == "Conv1D" and str(type(m).__module__).startswith("transformers"):
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[0]), int(weight.shape[1])
    return None


class _Dequantized(torch.autograd.Function):
    """A matmul against a weight dequantized for the occasion: a temporary of the compute dtype in the forward
    and again in the backward, never saved (bitsandbytes' ``MatMul4Bit`` and its fallback ``gemm_4bit``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None, layer: QuantLinear,
                fused: bool) -> torch.Tensor:
        ctx.layer = layer
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if fused:
            return _fused(x, layer)
        if layer.nested_blocks:  # the block constants, dequantized, then the offset added (a new tensor)
            absmax = torch.empty(layer.nested_blocks, dtype=torch.float32)
            absmax = absmax + 0.0
        weight = torch.empty(layer.out_features, layer.in_features, dtype=x.dtype)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layer = ctx.layer
        grad_bias = grad.sum(0, dtype=ctx.bias_dtype) if ctx.bias_grad else None
        if layer.nested_blocks:  # dequantized, the offset added in place
            absmax = torch.empty(layer.nested_blocks, dtype=torch.float32)
            absmax += 0.0
        weight = torch.empty(layer.out_features, layer.in_features, dtype=grad.dtype)
        grad_x = torch.matmul(grad, weight)
        return grad_x, None, grad_bias, None, None


def _fused(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """A fused quantized matmul: what the op allocates inside (freed before it returns) and its output."""
    shape = (*x.shape[:-1], layer.out_features)
    if layer.flavour == "fbgemm":
        scratch = torch.empty(shape, dtype=torch.int32)
        out = _output(x, layer, shape)
        del scratch
        return out
    if x.dtype == torch.bfloat16:
        return _output(x, layer, shape)
    a = torch.empty(x.shape, dtype=torch.bfloat16)
    result = torch.empty(shape, dtype=torch.bfloat16)
    out = _output(x, layer, shape)
    del a, result
    return out


def _output(x: torch.Tensor, layer: QuantLinear, shape: tuple[int, ...]) -> torch.Tensor:
    """A fused kernel's output, made by a matmul against the layer's *shadow* (a fake weight made with the layer,
    never counted: only what an op returns is) so that its FLOPs are counted; fp32 only (a half-precision matmul
    would be taken for a oneDNN GEMM with scratch of its own)."""
    shadow = layer.__dict__.get("_shadow")
    if x.dtype != torch.float32 or shadow is None:
        return x.new_empty(shape)
    return torch.mm(x.reshape(-1, layer.in_features), shadow).view(shape)


class QuantLinear(nn.Module):
    """A quantized linear layer on fake tensors: its tensors (frozen parameters) have the format's bytes; its
    forward allocates what the mirrored library allocates (``flavour``: see the module's docstring)."""

    keeps_dtypes = True  # its tensors keep the format's dtypes whatever dtype the estimate asks for

    def __init__(self, in_features: int, out_features: int, parts: list[tuple[str, tuple[int, ...], torch.dtype,
                 str]], *, fmt: str, flavour: str = "dequant", bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None, nested_blocks: int = 0, bits: int = 4) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.flavour, self.bits = fmt, flavour, bits
        self.compute_dtype = compute_dtype
        self.nested_blocks = nested_blocks
        self.roles: dict[str, str] = {}
        for name, shape, dtype, role in parts:
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
            self.roles[name] = role
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, False)
        if flavour in ("fbgemm", "bnb-cpu"):  # made under the fake mode with the layer: see _output
            self.__dict__["_shadow"] = torch.empty(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.flavour == "ao-int8":
            return self._torchao_int8(x)
        fused = self.flavour in ("fbgemm", "bnb-cpu")
        if fused and not torch.is_grad_enabled():
            return _Dequantized.forward(_Context(), x, self.weight, self.bias, self, True)
        return _Dequantized.apply(x, self.weight, self.bias, self, fused)

    def _torchao_int8(self, x: torch.Tensor) -> torch.Tensor:
        """torchao's ``Int8Tensor`` linear: ``mm(x, w.t().to(dtype)) * scale``, then the bias in place."""
        flat = x.reshape(-1, self.in_features)
        scale = self._parameters.get("scale")
        scale = scale.view(-1) if scale is not None else torch.ones((), dtype=x.dtype)
        # the converted weight is a temporary of the expression: freed once the matmul returns
        out = torch.mm(flat, torch.empty(self.out_features, self.in_features, dtype=x.dtype).t()) * scale
        if self.bias is not None:
            out = out.add_(self.bias) if not self.bias.requires_grad else out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def quantized(self) -> Iterator[tuple[nn.Parameter, str]]:
        """``(parameter, role)`` of the quantized tensors (the data and its constants)."""
        for name, role in self.roles.items():
            p = self._parameters.get(name)
            if p is not None:
                yield p, role

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt!r}"


class _Context:
    """What a forward outside autograd needs of ``ctx``."""


def make_quant_linear(linear: nn.Module, fmt: QuantFormat) -> QuantLinear:
    """The stand-in of a fake linear layer in ``fmt`` (call under the fake mode)."""
    in_f, out_f = features(linear)  # type: ignore[misc]
    dtype = linear.weight.dtype
    nested = -(-out_f * in_f // fmt.block) if fmt.nested else 0
    bias = None
    if linear.bias is not None:
        bias = nn.Parameter(torch.empty(linear.bias.shape, dtype=linear.bias.dtype), requires_grad=False)
    return QuantLinear(in_f, out_f, fmt.parts(out_f, in_f), fmt=fmt.name, bias=bias, compute_dtype=dtype,
                       nested_blocks=nested, bits=fmt.bits)


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that projects onto the vocabulary, which quantization and LoRA leave alone (transformers keeps
    it in the model's dtype; PEFT's ``all-linear`` skips it): the model's own output embeddings, or a last linear
    layer as wide as an embedding table."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:
            head = None
        if isinstance(head, nn.Module):
            return head
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [m for m in model.modules() if features(m) is not None]
    if linears and vocab and features(linears[-1])[1] in vocab:  # type: ignore[index]
        return linears[-1]
    return None


def linear_layers(model: nn.Module) -> list[tuple[nn.Module | None, str, nn.Module]]:
    """``(parent, attribute, layer)`` of every linear layer but the output head (parent ``None``: the model is
    one linear layer)."""
    if features(model) is not None:
        return [(None, "", model)]
    head = output_head(model)
    out: list[tuple[nn.Module | None, str, nn.Module]] = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not head and features(child) is not None:
                out.append((parent, name, child))
    return out


def replace_layers(model: nn.Module, layers: list[tuple[nn.Module | None, str, nn.Module]],
                   make: Any) -> nn.Module:
    """Each ``(parent, attribute, layer)`` of ``layers`` replaced by ``make(layer)`` (call under the fake mode); the
    model, a new one if it was a linear layer itself."""
    for parent, attr, layer in layers:
        new = make(layer)
        if parent is None:
            model = new
        else:
            parent._modules[attr] = new
    return model


def quantize_model(model: nn.Module, name: str, mode: Any) -> tuple[nn.Module, str]:
    """Replace the fake model's linear layers (not the head) by stand-ins in format ``name``; the model (a new
    one if it was a linear layer itself) and what was done."""
    fmt = FORMATS[name]
    layers = [(p, a, m) for p, a, m in linear_layers(model) if not isinstance(m, QuantLinear)]
    if not layers:
        raise NotApplicable(f"quantize={name!r}: the model has no linear layers to quantize (nn.Linear, or "
                            "transformers' Conv1D)")
    with mode:
        model = replace_layers(model, layers, lambda linear: make_quant_linear(linear, fmt))
    total = 0
    for _, _, linear in layers:
        in_f, out_f = features(linear)  # type: ignore[misc]
        total += fmt.layer_bytes(out_f, in_f)
    from ...core.units import format_bytes

    kept = ["the output head"] if output_head(model) is not None else []
    kept += ["embeddings"] if any(isinstance(m, nn.Embedding) for m in model.modules()) else []
    keep = f"; {' and '.join(kept)} and other layers kept as they are" if kept else ""
    return model, (f"quantized: {len(layers)} linear layers in {fmt.label}, {format_bytes(total)} of weights and "
            f"constants; each matmul dequantizes its weight into a temporary of the compute dtype, in the forward "
            f"and again in the backward (bitsandbytes' path for inputs of many rows){keep}")


def stand_ins(model: nn.Module, mode: Any) -> dict[int, nn.Module]:
    """``{id(real quantized layer): fake stand-in}`` for a model that is already quantized, to put in the memo
    of the deep copy that makes the fake model. A layer fake tensors cannot stand in for (static quantization,
    quantized convolutions) stops the estimate with a ``ValueError`` naming it, its op and what to do."""
    from ...engine.hooks.quantized import packed_info, packed_objects, subclass_format

    out: dict[int, nn.Module] = {}
    shared: dict[int, nn.Parameter] = {}  # real tensor -> its fake twin (bitsandbytes shares code books)
    for name, m in model.named_modules():
        if any(id(parent) in out for parent in _parents(model, name)):
            continue
        cls = type(m)
        where = f"module {name or '(the model)'!r} ({cls.__module__}.{cls.__name__})"
        if packed_objects(m) or _holds_packed(m):
            if cls.__name__ == "Linear" and ".dynamic." in cls.__module__:
                obj = m._packed_params._packed_params
                size, fmt, bias = packed_info(obj)
                with mode:
                    fake_bias = None if bias is None else nn.Parameter(
                        torch.empty(bias.shape, dtype=bias.dtype), requires_grad=False)  # kept in the object
                    out[id(m)] = QuantLinear(m.in_features, m.out_features, [("weight", (size,), torch.uint8, "data")],
                                             fmt=fmt, flavour="fbgemm", bias=fake_bias, bits=8)
                continue
            if cls.__name__ == "LinearPackedParams":
                continue  # inside a dynamic Linear, handled there
            op = _OPS.get(cls.__name__, f"quantized::{cls.__name__.lower()}")
            dynamic = ".dynamic." in cls.__module__
            what = "packed weights" if dynamic else "packed int8 weights and quantized activations"
            raise ValueError(
                f"{where} runs {op} on {what}, which fake tensors cannot run (only dynamic quantization's Linear is "
                "estimated as it is). Estimate the float model instead: quantize='int8', inference=True counts its "
                "linear layers at 1 byte per weight (docs/quantization.md); or measure the quantized model itself "
                "with %%vram / vram_magic.measure()")
        module = str(cls.__module__)
        weight = _own_weight(m)
        if module.startswith("bitsandbytes") and weight is not None and cls.__name__ in ("Linear4bit", "LinearNF4",
                                                                                          "LinearFP4", "Linear8bitLt"):
            out[id(m)] = _bnb_stand_in(m, weight, mode, shared)
            continue
        if isinstance(m, nn.Linear) and weight is not None and subclass_format(type(weight)):
            out[id(m)] = _torchao_stand_in(m, weight, mode)
    return out


_OPS = {"Linear": "quantized::linear", "LSTM": "quantized::quantized_lstm", "GRU": "quantized::quantized_gru",
        "Embedding": "quantized::embedding_byte", "EmbeddingBag": "quantized::embedding_bag_byte"}


def _own_weight(m: nn.Module) -> Any:
    """The module's own ``weight`` parameter, read from its table without ``__getattr__`` (a TorchScript
    module's table is a view of its C++ slots, not a dict)."""
    table = m.__dict__.get("_parameters")
    try:
        return table["weight"] if table is not None and "weight" in table else None
    except (KeyError, RuntimeError):
        return None


def _holds_packed(m: nn.Module) -> bool:
    """A torch.ao quantized module whose weights (its own or its submodules') are packed in TorchScript objects:
    fake tensors can neither copy nor run them."""
    from ...engine.hooks.quantized import is_ao_quantized

    if not is_ao_quantized(type(m)):
        return False
    return any(isinstance(v, torch.ScriptObject) for sub in m.modules() for v in sub.__dict__.values())


def _parents(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".") if name else []
    found, m = [], model
    for p in parts[:-1]:
        children = m._modules  # a ScriptModule's is an OrderedModuleDict: no .get()
        m = children[p] if p in children else None  # type: ignore[assignment]
        if m is None:
            break
        found.append(m)
    return found


def _fake_param(t: torch.Tensor, mode: Any, shared: dict[int, nn.Parameter], requires_grad: bool = False
                ) -> nn.Parameter:
    hit = shared.get(id(t))
    if hit is None:
        with mode:
            hit = shared[id(t)] = nn.Parameter(torch.empty(tuple(t.shape), dtype=t.dtype), requires_grad=requires_grad)
    return hit


def _fake_bias(m: nn.Module, mode: Any) -> nn.Parameter | None:
    bias = getattr(m, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return None
    with mode:
        return nn.Parameter(torch.empty(tuple(bias.shape), dtype=bias.dtype), requires_grad=bias.requires_grad)


def _bnb_stand_in(m: nn.Module, weight: torch.Tensor, mode: Any, shared: dict[int, nn.Parameter]) -> QuantLinear:
    """bitsandbytes' 4-bit or 8-bit layer with its own tensors: the packed data and the quantization constants as
    they are now (a 4-bit weight repacked for the CPU keeps bf16 absmax and runs the fused CPU kernel)."""
    in_f, out_f = m.in_features, m.out_features
    state = getattr(weight, "quant_state", None)
    tensors: list[tuple[str, torch.Tensor, str]] = [("weight", weight, "data")]
    flavour, nested, bits = "dequant", 0, 8
    if state is not None:  # 4-bit
        bits = 4
        fmt = str(getattr(state, "quant_type", "nf4"))
        for attr in ("absmax", "code", "offset"):
            t = getattr(state, attr, None)
            if isinstance(t, torch.Tensor):
                tensors.append((attr, t, "constants"))
        inner = getattr(state, "state2", None) if getattr(state, "nested", False) else None
        if inner is not None:
            fmt += "-dq"
            nested = int(state.absmax.numel())
            tensors += [(f"{attr}2", getattr(inner, attr), "constants") for attr in ("absmax", "code")
                        if isinstance(getattr(inner, attr, None), torch.Tensor)]
        if getattr(state, "packing_format_for_cpu", False):
            flavour = "bnb-cpu"
    else:
        fmt = "int8"
        scb = getattr(weight, "SCB", None)
        if scb is None:
            scb = getattr(getattr(m, "state", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            tensors.append(("SCB", scb, "constants"))
    bias = _fake_bias(m, mode)
    with mode:
        q = QuantLinear(in_f, out_f, [], fmt=f"{fmt}, bitsandbytes", flavour=flavour, bias=bias,
                        compute_dtype=getattr(m, "compute_dtype", None), nested_blocks=nested, bits=bits)
    for name, t, role in tensors:
        q.register_parameter(name, _fake_param(t, mode, shared))
        q.roles[name] = role
    return q


def _torchao_stand_in(m: nn.Linear, weight: torch.Tensor, mode: Any) -> QuantLinear:
    """A linear layer whose weight is one of torchao's quantized tensors: its inner tensors as they are."""
    from ...engine.hooks.quantized import subclass_format

    names, _ = weight.__tensor_flatten__()
    parts = []
    for i, name in enumerate(names):
        t = getattr(weight, name, None)
        if isinstance(t, torch.Tensor):
            parts.append(("weight" if i == 0 else name, tuple(t.shape), t.dtype, "data" if i == 0 else "constants"))
    flavour = "ao-int8" if type(weight).__name__ == "Int8Tensor" else "dequant"
    bias = _fake_bias(m, mode)
    with mode:
        return QuantLinear(m.in_features, m.out_features, parts, fmt=subclass_format(type(weight)), flavour=flavour,
                           bias=bias, compute_dtype=weight.dtype, bits=8)


def count_parameters(model: nn.Module) -> int:
    """Parameters as people count them: a quantized layer's weights once each, not its packed bytes and
    constants."""
    quantized: set[int] = set()
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            quantized.update(id(p) for p, _ in m.quantized())
            n += m.in_features * m.out_features
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in quantized and id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def parameter_labels(model: nn.Module) -> list[tuple[torch.Tensor, str]]:
    """How the estimate names parameters that are not plain trainable weights: quantized data and constants
    (by format), LoRA adapters, frozen weights — claimed before the plain ones (the first name sticks)."""
    out: list[tuple[torch.Tensor, str]] = []
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for p, role in m.quantized():
                out.append((p, f"parameters (frozen, {m.fmt}{' constants' if role == 'constants' else ''})"))
    for name, p in model.named_parameters():
        if p.requires_grad and ("lora_A" in name or "lora_B" in name):
            out.append((p, "parameters (LoRA adapters)"))
        elif not p.requires_grad:
            out.append((p, "parameters (frozen)"))
    return out


__all__ = ["FORMATS", "NotApplicable", "QuantFormat", "QuantLinear", "count_parameters", "features",
           "linear_layers", "output_head", "parameter_labels", "parse_quantize", "quantize_model", "stand_ins"]
