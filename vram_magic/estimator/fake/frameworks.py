"""What libraries of models do differently on fake tensors, and their own ways to checkpoint.

* transformers treats a fake tensor as *tracing* (``is_tracing``): it then keeps masks a real run drops and
  runs another attention graph. While a step is estimated, a fake tensor whose values are known (see
  ``known_values.py``) is not tracing: the model reads the values, as it would in the real run.
* ``module.to(dtype)`` on fake parameters fails in PyTorch (``swap_tensors`` refuses them), and PEFT moves
  every adapter with ``.to`` when it builds one: on fake modules the conversion replaces the tensors instead
  (tied tensors stay tied).
* Activation checkpointing runs through the model's own switch when it has one: transformers'
  ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` (which also stop the KV cache from
  being written twice), diffusers' ``enable_gradient_checkpointing``. Otherwise each block is wrapped in
  non-reentrant ``torch.utils.checkpoint``, with caching switched off the way transformers does it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...engine.torch_private import MODULE_APPLY, set_module_apply
from ..torch_private import FAKE_TENSOR_LOGGER, FakeTensorMode, function_modes
from .known_values import ATTR

# keyword arguments that carry or ask for a key/value cache, in the spellings models use
_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache", "past")


@contextlib.contextmanager
def estimating() -> Iterator[None]:
    """While a model is built and estimated: fake modules convert with ``.to``."""
    with _fake_modules_convert():
        yield


@contextlib.contextmanager
def fake_run() -> Iterator[Any]:
    """A fake run's surroundings, its fake mode yielded: real inputs allowed, fake tensors' own log silenced (they
    log a model's shape errors; the estimate says it once, clearly), warnings ignored, fake modules converting with
    ``.to``."""
    import logging
    import warnings

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    log = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), estimating():
            warnings.simplefilter("ignore")
            yield mode
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def not_tracing() -> Iterator[None]:
    """While the step runs: fake tensors with known values are not *tracing* for transformers (entered after
    the model is built, so a builder that imports transformers itself is covered), and a 0-d one formats as its value,
    as a real one does (``f"expert_{idx}"``: Switch Transformers names its experts so; ``Tensor.__format__`` reads the
    value of plain tensors only)."""
    from ..torch_private import FakeTensor

    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None) if utils is not None else None

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and getattr(x, ATTR, None) is None

    if original is not None:
        utils.is_fake_tensor = is_fake_tensor
    own = FakeTensor.__dict__.get("__format__")  # None: the one it inherits from Tensor
    FakeTensor.__format__ = _format  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__format__
        else:
            FakeTensor.__format__ = own  # type: ignore[method-assign]
        if original is not None:
            utils.is_fake_tensor = original


def _format(self: torch.Tensor, spec: str) -> str:
    value = getattr(self, ATTR, None)
    if value is not None and self.dim() == 0:
        return value.item().__format__(spec)
    return torch.Tensor.__format__(self, spec)


_module_apply = MODULE_APPLY


def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    from ..torch_private import FakeTensor

    tensors = [t for m in (self.modules() if recurse else (self,)) for table in (m._parameters, m._buffers)
               for t in table.values() if t is not None]
    if not any(isinstance(t, FakeTensor) for t in tensors):
        return _module_apply(self, fn, recurse)
    memo: dict[int, torch.Tensor] = {}
    for m in self.modules() if recurse else (self,):
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                new = memo.get(id(t))
                if new is None:
                    with torch.no_grad():
                        made = fn(t)
                    if made is t:
                        new = t
                    elif isinstance(t, nn.Parameter):
                        new = nn.Parameter(made, requires_grad=t.requires_grad)
                    else:
                        new = made
                    memo[id(t)] = new
                table[name] = new
    return self


@contextlib.contextmanager
def _fake_modules_convert() -> Iterator[None]:
    set_module_apply(_apply)
    try:
        yield
    finally:
        set_module_apply(_module_apply)


def enable_checkpointing(model: nn.Module, units: list[nn.Module], every: int = 1, modes: bool = True,
                         context_fn: Any = None) -> str:
    """Switch activation checkpointing on in the (fake) model, for every block or every ``every``-th one; say how.
    The checkpoints are non-reentrant and, with ``modes``, enter the forward's function modes again for the recompute
    (:func:`modes_again`; not in a compiled model, where TorchDynamo refuses a ``context_fn`` and no mode runs);
    ``context_fn``: checkpoint's own instead (op-level selective checkpointing: ``step/recipes/op_checkpointing.py``,
    which enters the modes again itself)."""
    again = {"context_fn": context_fn} if context_fn is not None else {"context_fn": modes_again} if modes else {}
    for name, kwarg in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                        ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        switch = _own(model, name)
        if switch is None or not getattr(_base(model), "supports_gradient_checkpointing", True):
            continue
        try:
            params = inspect.signature(switch).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        call: dict[str, Any] = {kwarg: {"use_reentrant": False, **again}} if kwarg in params else {}
        if every > 1:
            if "every_n_layers" not in params:
                continue
            call["every_n_layers"] = every
        try:
            switch(**call)
        except (ValueError, TypeError, NotImplementedError):
            continue
        _no_cache(model)
        return f"the model's own {name}({f'every_n_layers={every}' if every > 1 else ''}) (non-reentrant)"
    if every > 1:
        return _every_kth(model, units, every, again)
    switch = _own(model, "enable_gradient_checkpointing")
    if switch is not None and getattr(_base(model), "_supports_gradient_checkpointing", True):
        try:
            switch()
            return "the model's own enable_gradient_checkpointing()"
        except (ValueError, TypeError, NotImplementedError):
            pass
    _no_cache(model)
    for u in units:
        _wrap_checkpoint(u, again)
    return f"torch.utils.checkpoint (non-reentrant) around each of {len(units)} blocks"


def _every_kth(model: nn.Module, units: list[nn.Module], every: int, again: dict[str, Any]) -> str:
    """Checkpointing of blocks 0, k, 2k, … by ``torch.utils.checkpoint`` around those blocks (a model whose own switch
    has no ``every_n_layers``)."""
    chosen = units[::every]
    _no_cache(model)
    for u in chosen:
        _wrap_checkpoint(u, again)
    return f"torch.utils.checkpoint (non-reentrant) around {len(chosen)} of {len(units)} blocks (every {every})"


def _own(model: nn.Module, name: str) -> Any:
    """``model.name`` if the model (or the model a wrapper such as PEFT's holds) has it."""
    with contextlib.suppress(Exception):
        return getattr(model, name)
    return None


def _base(model: nn.Module) -> Any:
    get = getattr(model, "get_base_model", None)
    if callable(get):
        with contextlib.suppress(Exception):
            return get()
    return model


def _no_cache(model: nn.Module) -> None:
    """A recomputed forward must not write the key/value cache a second time: caching off, as transformers
    does when it checkpoints."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "use_cache", None):
            with contextlib.suppress(Exception):
                config.use_cache = False


class _ModesAgain:
    r"""The ``TorchFunctionMode``\ s of a checkpointed forward, entered again for its recompute: the backward runs
    the recompute with no function mode on the stack, so a mode that chooses CUDA's kernels above autograd (SDPA,
    dropout: ``estimator/device/sdpa.py``) would see the forward and not its recompute, which would then save other
    tensors than the forward did (PyTorch's checkpoint refuses that)."""

    def __init__(self, modes: list[Any]) -> None:
        self.modes = modes
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        active = function_modes()
        for mode in self.modes:
            if not any(mode is m for m in active):
                self.stack.enter_context(mode)

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def modes_again() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing for the forward, its function modes for the recompute."""
    return contextlib.nullcontext(), _ModesAgain(function_modes())


def _wrap_checkpoint(unit: nn.Module, again: dict[str, Any]) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = unit.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        return checkpoint(inner, *args, use_reentrant=False, **again, **kwargs)

    unit.forward = forward  # type: ignore[method-assign]


def without_init(model: Any) -> Any:
    """A model builder run with transformers' weight initialization off (``no_init_weights``: fake weights have
    no values to initialize, and an 8B model's initialization is most of its build time); anything else as
    it is. transformers 5's ``no_init_weights`` stubs out ``PreTrainedModel.init_weights``, which ``post_init``
    calls to initialize *and tie* the weights: the tying is put back, so tied embeddings stay one tensor (what the
    builder does after construction, untying included, stands)."""
    from torch import nn

    if isinstance(model, nn.Module) or not callable(model):
        return model
    try:
        from transformers import PreTrainedModel
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers import PreTrainedModel
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
        except ImportError:
            return model
    import functools

    @functools.wraps(model)
    def build() -> Any:
        original = PreTrainedModel.init_weights
        with no_init_weights():
            stub = PreTrainedModel.init_weights
            if stub is not original:  # transformers 5: init_weights stubbed out, its tie_weights with it
                PreTrainedModel.init_weights = _tie_only  # type: ignore[method-assign]
            try:
                return model()
            finally:
                PreTrainedModel.init_weights = stub  # type: ignore[method-assign]

    return build


def _tie_only(self: Any) -> None:
    """``PreTrainedModel.init_weights`` (transformers 5.x) less the initialization: the tying, by the mapping
    ``post_init`` has just computed."""
    import inspect

    if "recompute_mapping" in inspect.signature(self.tie_weights).parameters:
        self.tie_weights(recompute_mapping=False)
    else:
        self.tie_weights()
