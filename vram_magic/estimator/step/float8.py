"""``float8=True``: torchao's float8 training (``torchao.float8.convert_to_float8_training``) on the fake copy, as
torchtitan applies it: every ``nn.Linear`` but the output head, whose features both divide by 16 (what
``torch._scaled_mm`` takes), becomes a ``Float8Linear`` with the default recipe (tensor-wise dynamic scaling).

What a ``Float8Linear`` holds (torchao 0.18, ``torchao/float8/float8_linear.py``): its weight in the weight's own dtype
(no float8 copy is kept), and for backward its autograd function (``matmul_with_hp_or_float8_args``) saves the input
and the weight in *high* precision — so the activations are those of the plain linear layers. The float8 tensors
(e4m3 input and weight in the forward, e5m2 output gradient in the backward, each with an fp32 scale;
``Float8TrainingTensor``) are temporaries of each matmul, and each cast (``hp_tensor_to_float8_dynamic``) makes
high-precision temporaries first in eager mode (the absolute value and its maximum, the scaled copy). The step runs
that code on fake tensors, so all of it is counted as the real run makes it; under ``torch.compile`` the casts fuse
and those temporaries go (not modelled: the eager step is estimated). FSDP2's float8 all-gather
(``enable_fsdp_float8_all_gather``) is off by default and not modelled.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: the notes' words for what the conversion did
NOTE = ("float8: torchao's convert_to_float8_training on {n} linear layers (tensor-wise dynamic scaling; not the "
        "output head{skipped}); a Float8Linear saves its input and weight for backward in their own precision, so the "
        "activations are the plain layers', and its float8 casts (e4m3 input and weight, e5m2 gradient, fp32 scales) "
        "are temporaries of each matmul, traced as eager mode makes them (torch.compile fuses them)")


def head_of(model: nn.Module) -> Any:
    """The output head (a transformers model's output embeddings), which float8 recipes leave in high precision."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:
        head = None
    if head is None:
        for name in ("lm_head", "output", "head"):
            m = getattr(model, name, None)
            if isinstance(m, nn.Linear):
                return m
    return head


def float8_linears(model: nn.Module, mode: Any, notes: list[str]) -> nn.Module:
    """``model`` with its linear layers converted (in place, under the fake mode ``mode``); what was done appended to
    ``notes``. ``ValueError`` when torchao is not installed or no layer can be converted."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ValueError(f"float8=True needs torchao (pip install torchao): {err}") from err
    head = head_of(model)
    skipped: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or module is head:
            return False
        if module.in_features % 16 or module.out_features % 16:
            skipped.append(name)
            return False
        return True

    with mode:
        convert_to_float8_training(model, module_filter_fn=chosen)
    from torchao.float8.float8_linear import Float8Linear

    n = sum(isinstance(m, Float8Linear) for m in model.modules())
    if not n:
        raise ValueError("float8=True found no linear layer to convert: torchao's float8 matmul needs both features "
                         "divisible by 16, and the output head stays in high precision")
    extra = f", nor {len(skipped)} whose features do not divide by 16" if skipped else ""
    notes.append(NOTE.format(n=n, skipped=extra))
    return model


__all__ = ["NOTE", "float8_linears", "head_of"]
