"""Where the user's code position of an allocation can be taken once for many allocations.

Every allocation the tracker counts is named by the user's frames above it (frames.user_site), a walk up the stack
that costs as much as the rest of the allocation's bookkeeping. Two places fix those frames for a while:

* a module of PyTorch's own (``nn.Linear``, ``nn.Sequential``) runs none of the user's code while its forward runs,
  unless the module has forward hooks of its own or a ``forward`` set on the instance (accelerate's and PEFT's
  wrappers): every allocation inside has the frames of the line that called it (its submodules are judged as they
  are entered). Hooks registered for every module (``register_module_forward_hook``) are not looked into: memory a
  user's global hook allocates is named by the line that called the model.
* an op that autograd's engine runs for a node of its own (no Python backward in between) has the engine's frame
  right above it, and above that the frames of the ``backward()`` call, which do not change while that graph task
  runs (``torch._C._current_graph_task_id``, unique per task).
"""

from __future__ import annotations

import os
from types import CodeType, FrameType
from typing import Any

from .frames import is_user_code

_plain_forward: dict[type, bool] = {}
_ENGINE_FILE = os.path.join("autograd", "graph.py")
_engine: dict[int, tuple[bool, CodeType]] = {}  # id(code) -> (the engine's frame runs it, the code, kept alive)


def plain_forward(module: Any) -> bool:
    """Nothing of the user's runs in ``module``'s forward, outside its submodules."""
    cls = type(module)
    hit = _plain_forward.get(cls)
    if hit is None:
        forward = getattr(cls, "forward", None)
        code = getattr(getattr(forward, "__wrapped__", forward), "__code__", None)
        hit = _plain_forward[cls] = code is not None and not is_user_code(code) and "__call__" not in vars(cls)
    if not hit:
        return False
    try:
        d = module.__dict__
        return not d["_forward_hooks"] and not d["_forward_pre_hooks"] and "forward" not in d
    except (AttributeError, KeyError):
        return False


def engine_frame(frame: FrameType) -> bool:
    """``frame`` is autograd's engine running a backward pass (``torch.autograd.graph._engine_run_backward``)."""
    code = frame.f_code
    hit = _engine.get(id(code))
    if hit is None:
        found = code.co_name == "_engine_run_backward" and code.co_filename.endswith(_ENGINE_FILE)
        hit = _engine[id(code)] = (found, code)
    return hit[0]


__all__ = ["engine_frame", "plain_forward"]
