"""Inductor's layout optimization on the CPU, as the estimate's graph runner models it.

With oneDNN available, Inductor runs every graph that has convolutions channels-last (``decide_layout_opt``):
the forward's first kernel copies each convolution weight and each 4-d graph input a convolution reads into a
channels-last buffer, and those copies (not the originals) are what the convolutions read and what the
forward saves for the backward, so they live until the backward has used them. The activations follow the
layout, and the backward's convolutions run on channels-last tensors too, returning each weight's gradient
channels-last, copied into the parameter's own layout at the end. What oneDNN allocates inside such a
convolution (no reorders of its inputs) is measured channels-last as well.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

CONV = torch.ops.aten.convolution.default
CONV_BACKWARD = torch.ops.aten.convolution_backward.default


def applies(gm: torch.fx.GraphModule, target: str) -> bool:
    """Whether Inductor would run this graph's convolutions channels-last: a CPU step with oneDNN."""
    if target != "cpu" or not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    return any(node.target in (CONV, CONV_BACKWARD) for node in gm.graph.nodes)


def converted_inputs(gm: torch.fx.GraphModule) -> set[Any]:
    """The graph's inputs that a convolution reads as its input or weight (4-d): copied channels-last first."""
    out: set[Any] = set()
    for node in gm.graph.nodes:
        if node.target is CONV:
            for arg in node.args[:2]:
                if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and _is_4d(arg):
                    out.add(arg)
    return out


def weight_gradients(gm: torch.fx.GraphModule) -> set[Any]:
    """The backward convolutions whose weight gradient leaves the graph (copied to the parameter's layout)."""
    outputs: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs.update(node.all_input_nodes)
    out: set[Any] = set()
    for node in gm.graph.nodes:
        if node.target is CONV_BACKWARD:
            for user in node.users:
                if user.target is operator.getitem and user.args[1] == 1 and user in outputs:
                    out.add(node)
    return out


def channels_last(t: Any) -> Any:
    """The copy Inductor makes of a 4-d tensor that is not channels-last already (a new buffer of its size),
    else ``t``. The copy keeps the tensor's own strides: the graph's views were traced on them, and only its
    memory matters here (the convolutions' scratch is measured channels-last by the tracer)."""
    if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last):
        return t.clone()
    return t


def with_contiguous_weight_gradient(out: Any) -> Any:
    """``convolution_backward``'s results with the weight gradient copied into a new contiguous buffer (the
    channels-last one it came in is dropped after the copy)."""
    if not isinstance(out, (tuple, list)) or len(out) < 2 or not isinstance(out[1], torch.Tensor):
        return out
    copy = torch.empty(tuple(out[1].shape), dtype=out[1].dtype)
    copy.copy_(out[1])
    return (out[0], copy, *out[2:])


def _is_4d(node: Any) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 4
