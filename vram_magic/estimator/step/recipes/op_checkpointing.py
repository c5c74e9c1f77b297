"""``checkpointing="ops"``: op-level selective activation checkpointing of each block
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``), applied to the blocks ``checkpointing=True`` wraps
(the model's own ``gradient_checkpointing_enable`` with a ``context_fn``, else ``torch.utils.checkpoint`` around each
block: ``fake/frameworks.py``).

``"ops"`` is torchtitan's "op" policy (the ``_save_list`` and ``_get_custom_policy`` of its Llama 3 ``parallelize``,
as its releases of 2024 and 2025 ship it): the outputs of the matmuls (``aten.mm``) and of attention are
saved, every second ``mm`` of a block recomputed, and everything else (norms, activations, rotary embeddings, the
elementwise ops) recomputed in the backward. The attention kernels saved are the CUDA ones torchtitan names, with the
CPU's flash kernel beside them (torchtitan runs on GPUs only). Newer torchtitan names the tensors to save per model
(``sac_save_list``); give such a policy as ``checkpointing=policy``: a function ``policy(ctx, op, *args, **kwargs) ->
CheckpointPolicy`` (or a bool), or a list of ops whose outputs are saved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_MM = torch.ops.aten.mm.default


def _ops(*names: str) -> frozenset[Any]:
    """The ``aten`` ops of ``names`` this PyTorch has."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


#: torchtitan's ``_save_list`` (its reduce-scatter left out: the estimate's collectives are modelled, not run)
SAVE_LIST = _ops("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max")


def torchtitan_policy() -> Callable[..., CheckpointPolicy]:
    """One block's policy (a counter of its matmuls, forward and recompute apart): torchtitan's ``_custom_policy``."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == _MM:
            meta[key] += 1
        save = func in SAVE_LIST and not (func == _MM and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Both:
    """Two contexts entered as one (the forward's function modes again, and the policy's recompute mode)."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self.stack = ExitStack()

    def __enter__(self) -> None:
        for c in self.contexts:
            self.stack.enter_context(c)

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def context_fn(choice: Any, modes: bool) -> Callable[[], tuple[Any, Any]]:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``choice`` (``"ops"``, a policy function or the ops to save);
    ``modes``: the forward's function modes entered again for the recompute (``fake/frameworks.modes_again``)."""
    from ...fake.frameworks import modes_again

    def make() -> tuple[Any, Any]:
        policy = torchtitan_policy() if choice == "ops" else list(choice) if isinstance(choice, tuple) else choice
        forward, recompute = create_selective_checkpoint_contexts(policy)
        if modes:
            recompute = _Both(modes_again()[1], recompute)
        return forward, recompute

    return make


def describe(choice: Any) -> str:
    if choice == "ops":
        return ("op-level selective checkpointing (torchtitan's op policy: matmul and attention outputs saved, every "
                "second matmul and the pointwise ops recomputed)")
    if isinstance(choice, tuple):
        return f"op-level selective checkpointing saving the outputs of {', '.join(str(o) for o in choice)}"
    return f"op-level selective checkpointing with the policy {getattr(choice, '__name__', repr(choice))}"


__all__ = ["SAVE_LIST", "context_fn", "describe", "torchtitan_policy"]
