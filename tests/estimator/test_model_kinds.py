"""Model kinds a summary tool meets (torchinfo's test models): TorchScript modules, lazy modules, named-tuple
inputs. Each is estimated, its parameter bytes checked by hand and its peak against the real CPU steps."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest
import torch
from torch import nn

import vram_magic
from tests.support.zoo import real_peak

TOLERANCE = 0.005  # the estimate's CPU target (docs/estimate.md)


class Net(nn.Module):
    """Two linear layers; ``a`` runs twice, as a TorchScript interpreter and autograd keep its results."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * torch.sigmoid(self.a(x)))


NET_PARAMS = (256 * 1024 + 1024) + (1024 * 256 + 256)  # 525,568 parameters
NET_BYTES = 4 * NET_PARAMS


class WithScriptedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.jit.script(Net())
        self.head = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def batch() -> torch.Tensor:
    return torch.randn(512, 256, generator=torch.Generator().manual_seed(0))


def _real(model: nn.Module, inputs, **kwargs) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return real_peak(lambda: model, lambda: inputs, **kwargs)


def _close(est, real: int) -> None:
    assert abs(est.peak.total - real) / real < TOLERANCE, (est.peak.total, real)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_model_is_estimated_and_left_as_it_was(how):
    torch.manual_seed(0)
    x = batch()
    model = torch.jit.script(Net()) if how == "script" else torch.jit.trace(Net(), x)
    weights = list(model.parameters())
    before = model(x).detach()
    est = vram_magic.estimate(model, x, device="cpu")
    assert est.parameters == NET_PARAMS
    assert est.peak["parameters"] == NET_BYTES
    assert est.model_states == NET_BYTES * 4 + 4 * 4  # weights, gradients, AdamW's two moments, 4 step counters
    # the user's module: the same real weights, no gradients, and its compiled code still runs as before
    assert [p is q for p, q in zip(weights, model.parameters())] == [True] * 4
    assert all(p.grad is None and not p.is_meta and type(p) is nn.Parameter for p in model.parameters())
    assert torch.equal(model(x), before)
    _close(est, _real(model, x))


def test_a_model_with_a_scripted_child():
    torch.manual_seed(0)
    model, x = WithScriptedChild(), batch()
    est = vram_magic.estimate(model, x, device="cpu")
    assert est.parameters == NET_PARAMS + 256 * 64 + 64
    assert est.peak["parameters"] == NET_BYTES + 4 * (256 * 64 + 64)
    assert all(p.grad is None for p in model.parameters())
    real = _real(model, x)
    _close(est, real)
    # TorchScript's optimized graph (its own autodiff) saves more than eager autograd does: the estimate runs the
    # same executor, so it sees the difference
    eager = WithScriptedChild()
    eager.inner = Net()
    eager_real = _real(eager, x)
    eager_est = vram_magic.estimate(eager, x, device="cpu")
    _close(eager_est, eager_real)
    assert real - eager_real > 4 * 2**20
    assert abs((est.peak.total - eager_est.peak.total) - (real - eager_real)) < 64 * 1024


class Nested(nn.Module):
    """Children with children: a Sequential inside a Sequential, beside a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Sequential(nn.Linear(256, 1024), nn.ReLU()), nn.Linear(1024, 256))
        self.head = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class NestedInference(Nested):
    """The same model scripted as its own type: TorchScript shares the executor of a class's scripted modules, and
    one optimized by training steps (its autodiff graph) refuses inference_mode, in PyTorch as in the estimate."""


NESTED_PARAMS = NET_PARAMS + 256 * 64 + 64  # 542,016


@pytest.mark.parametrize("inference", [False, True])
def test_a_scripted_model_whose_children_have_children(inference):
    """A ScriptModule's children are an OrderedModuleDict (no .get()), two levels down here."""
    torch.manual_seed(0)
    x = batch()
    model = torch.jit.script(NestedInference() if inference else Nested())
    est = vram_magic.estimate(model, x, device="cpu", inference=inference)
    assert est.parameters == NESTED_PARAMS
    assert est.peak["parameters"] == 4 * NESTED_PARAMS
    assert all(p.grad is None for p in model.parameters())
    _close(est, _real(model, x, inference=inference))
    eager = Nested()
    eager.load_state_dict(model.state_dict())
    eager_est = vram_magic.estimate(eager, x, device="cpu", inference=inference)
    assert eager_est.parameters == est.parameters
    _close(eager_est, _real(eager, x, inference=inference))


def test_a_frozen_torchscript_module_is_refused_with_what_to_do():
    frozen = torch.jit.freeze(torch.jit.script(Net().eval()))
    with pytest.raises(ValueError, match=r"frozen TorchScript module \(torch.jit.freeze\).*before torch.jit.freeze"):
        vram_magic.estimate(frozen, batch(), device="cpu", inference=True)


def lazy_model() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(512), nn.ReLU(), nn.LazyLinear(64))


LAZY_PARAMS = (128 * 512 + 512) + (512 * 64 + 64)  # 98,880 once the input's 128 features are seen


def test_a_lazy_module_not_yet_initialized_is_estimated_and_stays_uninitialized():
    x = torch.randn(256, 128)
    model = lazy_model()
    est = vram_magic.estimate(model, x, device="cpu")
    assert est.parameters == LAZY_PARAMS
    assert est.peak["parameters"] == 4 * LAZY_PARAMS
    assert vram_magic.estimate(model, x, device="cpu", dtype="bf16").peak["parameters"] == 2 * LAZY_PARAMS
    # the user's module is left as it was: lazy, its parameters still to be made
    assert type(model[0]) is nn.LazyLinear and isinstance(model[0].weight, nn.UninitializedParameter)
    assert all(isinstance(p, nn.UninitializedParameter) for p in model.parameters())

    def initialized() -> nn.Module:  # the real steps: PyTorch's advice, one forward before the optimizer is made
        torch.manual_seed(0)
        m = lazy_model()
        m(x)
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = real_peak(initialized, lambda: x)
    _close(est, real)


class LazyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.LazyConv2d(16, 3, padding=1), nn.LazyBatchNorm2d(), nn.LazyLinear(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(y.flatten(1) + torch.arange(y[0].numel(), dtype=y.dtype))  # a tensor made in forward


def test_lazy_convolution_and_batch_norm():
    x = torch.randn(8, 3, 16, 16)
    est = vram_magic.estimate(LazyConvNet(), x, device="cpu")
    conv, bn, head = 3 * 16 * 9 + 16, 2 * 16, 16 * 16 * 16 * 10 + 10
    assert est.parameters == conv + bn + head
    assert est.peak["parameters"] == 4 * (conv + bn + head)

    def initialized() -> nn.Module:
        torch.manual_seed(0)
        m = LazyConvNet()
        m(x)
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = real_peak(initialized, lambda: x)
    _close(est, real)


def test_a_builder_of_lazy_modules_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="lazy modules.*pass the built module"):
        vram_magic.estimate(lazy_model, torch.randn(4, 128), device="cpu")


class Batch(NamedTuple):
    x: torch.Tensor
    mask: torch.Tensor


class ReadsFields(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 32)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.lin(batch.x) * batch.mask


class TakesFields(ReadsFields):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.lin(x) * mask


def named_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(torch.randn(128, 64, generator=g), torch.ones(128, 32))


def test_named_tuple_inputs_keep_their_fields():
    b = named_batch()
    inputs_bytes = 128 * 64 * 4 + 128 * 32 * 4  # x and mask, by hand (the reference counts only top-level tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = real_peak(ReadsFields, lambda: (b,)) + inputs_bytes
    for inputs in (b, (b,), {"batch": b}, named_batch):  # the batch itself, as the one argument, by name, a callable
        est = vram_magic.estimate(ReadsFields(), inputs, device="cpu")
        assert est.peak["parameters"] == 4 * (64 * 32 + 32)
        assert est.batch == 128
        _close(est, real)
    # a forward that takes the fields as its arguments gets them so, as from a plain tuple
    est = vram_magic.estimate(TakesFields(), b, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(est, real_peak(TakesFields, lambda: tuple(b)))
    # what-ifs resize the named tuple's tensors and keep its type
    est = vram_magic.estimate(ReadsFields(), b, device="cpu", budget="10MiB", max_batch=True)
    assert est.max_batch is not None and est.max_batch > 128
