"""What to estimate: the model's source, the inputs (shapes, or a callable run once on fake tensors) and the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..torch_private import FakeTensorMode
from ..tracing.errors import EstimateError
from ..tracing.tracer import FAKE_PROBLEMS
from .convert import ModelSource, specs_in, to_specs


class Request:
    """What to estimate: the model's source, the inputs (specs or a callable) and the loss function."""

    def __init__(self, model: Any, inputs: Any, loss_fn: Callable[[Any], Any] | None = None,
                 name: str | None = None) -> None:
        self.source = ModelSource(model)
        self.given_name = name
        if callable(inputs) and not isinstance(inputs, torch.Tensor):
            self.inputs_fn: Callable[[], Any] | None = inputs
            self.specs: Any = None
        else:
            self.inputs_fn = None
            self.specs = to_specs(inputs)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable output -> scalar tensor, not {type(loss_fn).__name__}")
        self.loss_fn = loss_fn

    @property
    def name(self) -> str:
        """What the report calls the model: the name given, else the model's class (a builder's once it has built
        one)."""
        return self.given_name or self.source.name

    def fake_model(self, mode: FakeTensorMode, dtype: Any) -> tuple[Any, dict[str, str]]:
        """The model on fake tensors and its compiled parts; a constructor that fails says so plainly."""
        try:
            return self.source.fake(mode, dtype)
        except (TypeError, ValueError):
            raise
        except FAKE_PROBLEMS as err:
            raise EstimateError(f"building the model on fake tensors failed at {err}: the model's constructor reads "
                                "tensor values; pass an nn.Module built normally instead of a builder") from err
        except Exception as err:
            raise EstimateError(f"building the model raised {type(err).__name__}: {err}") from err

    def input_specs(self, mode: FakeTensorMode) -> Any:
        if self.specs is None:
            assert self.inputs_fn is not None
            from .known_values import ValueMode

            with mode, ValueMode():
                try:
                    made = self.inputs_fn()
                except Exception as err:
                    raise EstimateError(f"the inputs callable raised {type(err).__name__}: {err}") from err
            specs = to_specs(made)
            if not specs_in(specs):
                raise TypeError("the inputs callable must return a tensor, or a tuple/list or dict of tensors; "
                                f"it returned {type(made).__name__}")
            self.specs = specs  # shapes only: the callable runs once
        return self.specs
