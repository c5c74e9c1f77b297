"""The real values the estimator keeps beside small fake tensors (vram_magic/estimator/fake/known_values.py):
deterministic factories
get them, uninitialized memory never does, and the kwargs a jump over decoding steps grows carry the values the
real loop would give them (a padding mask keeps its zeros, so the model keeps the mask)."""

from __future__ import annotations

import pytest
import torch

from vram_magic.estimator.fake.known_values import attach, propagate, value_of
from vram_magic.estimator.generate.loop import grown_value
from vram_magic.estimator.torch_private import FakeTensorMode

aten = torch.ops.aten


def _fake_call(func, *args, **kwargs):
    with FakeTensorMode():
        out = func(*args, **kwargs)
    propagate(func, args, kwargs, out)
    return out


def test_a_deterministic_factory_gets_its_values():
    out = _fake_call(aten.ones.default, [2, 3], dtype=torch.long)
    assert torch.equal(value_of(out), torch.ones(2, 3, dtype=torch.long))
    out = _fake_call(aten.arange.default, 5, dtype=torch.long)
    assert value_of(out).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("func, args", [
    (aten.empty.memory_format, ([2, 143],)),
    (aten.empty_strided.default, ([2, 143], [143, 1])),
])
def test_uninitialized_memory_gets_no_values(func, args):
    """Its values would be whatever the allocator handed out: ``mask.all()`` on them steered the estimate of a
    left-padded prompt to drop the mask (flash attention instead of memory-efficient) in some processes."""
    torch.full((2, 143), 7, dtype=torch.long)  # freed memory a real empty() may reuse
    out = _fake_call(func, *args, dtype=torch.long)
    assert value_of(out) is None


def test_a_grown_attention_mask_keeps_its_padding_and_gains_ones():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    grown = grown_value("attention_mask", mask, 3)
    assert grown.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    assert grown_value("decoder_attention_mask", mask, 1).tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_grown_positions_count_on_and_token_types_repeat():
    positions = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]])
    assert grown_value("position_ids", positions, 2).tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    rope3d = torch.arange(4).view(1, 1, 4).expand(3, 1, 4)  # 3-D positions (multimodal rope)
    assert grown_value("position_ids", rope3d, 1)[:, 0].tolist() == [[0, 1, 2, 3, 4]] * 3
    types = torch.tensor([[0, 1, 1]])
    assert grown_value("token_type_ids", types, 2).tolist() == [[0, 1, 1, 1, 1]]
    assert grown_value("mm_token_type_ids", types, 2).tolist() == [[0, 1, 1, 0, 0]]
    assert grown_value("attention_mask", None, 2) is None


@pytest.mark.parametrize("fill", ["fill_", "copy_"])
def test_uninitialized_memory_filled_in_place_has_the_filled_values(fill):
    mode = FakeTensorMode()
    with mode:
        out = aten.empty.memory_format([2, 3], dtype=torch.long)
    propagate(aten.empty.memory_format, ([2, 3],), {"dtype": torch.long}, out)
    if fill == "fill_":
        args, func = (out, 1), aten.fill_.Scalar
    else:
        with mode:
            source = aten.arange.default(6, dtype=torch.long)
        propagate(aten.arange.default, (6,), {"dtype": torch.long}, source)
        args, func = (out, source.view(2, 3)), aten.copy_.default
        attach(args[1], value_of(source).view(2, 3))
    with mode:
        func(*args)
    propagate(func, args, {}, out)
    expected = [[1, 1, 1], [1, 1, 1]] if fill == "fill_" else [[0, 1, 2], [3, 4, 5]]
    assert value_of(out).tolist() == expected
