"""Does a cell run ``torch.compile``d code? Asked before the cell runs, to pick the backend that lets it run
compiled: a dispatch mode on the stack makes compiled code run eagerly (and global module hooks change what
dynamo traces), so such a cell is measured at the allocator instead.

Cheap and conservative: nothing compiled exists unless ``torch._dynamo`` has been imported, and the cell's
own text tells whether it is about to compile something.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from ..torch_private import DYNAMO_MODULE, optimized_module_class

_COMPILES = re.compile(r"\btorch\.compile\b|\.compile\s*\(|\bcompile\s*\(\s*[A-Za-z_]")
_MAX_VALUES = 5_000
_MAX_MODULES = 20_000


def compiled_reason(namespace: Mapping[str, Any] | None, source: str = "") -> str:
    """Why the block should be taken as running compiled code ("" if it need not): the cell compiles
    something, or the namespace holds a compiled module (``torch.compile(model)``, ``model.compile()``, a
    compiled submodule), a compiled function or a torchao optimizer."""
    if source and _COMPILES.search(_without_strings(source)):
        return "the cell calls compile"
    if DYNAMO_MODULE not in sys.modules or not namespace:
        return ""
    try:
        OptimizedModule = optimized_module_class()
    except Exception:  # a PyTorch whose dynamo cannot be imported compiles nothing
        return ""
    import torch

    modules_seen = 0
    try:
        values = list(namespace.items())[:_MAX_VALUES]
    except Exception:
        return ""
    for name, value in values:
        try:
            if isinstance(value, OptimizedModule):
                return f"{name} is a compiled module"
            if isinstance(value, torch.optim.Optimizer) and type(value).__module__.startswith("torchao."):
                # torchao's low-bit optimizers compile each parameter's update (torchao 0.18: torchao/optim/adam.py)
                return f"{name} is a torchao optimizer, whose step is compiled"
            if isinstance(value, torch.nn.Module):
                if getattr(value, "_compiled_call_impl", None) is not None:
                    return f"{name} was compiled with {name}.compile()"
                for sub in value.modules():
                    modules_seen += 1
                    if modules_seen > _MAX_MODULES:
                        break
                    if isinstance(sub, OptimizedModule) or getattr(sub, "_compiled_call_impl", None) is not None:
                        return f"{name} holds a compiled submodule"
            elif callable(value) and getattr(value, "_torchdynamo_orig_callable", None) is not None:
                return f"{name} is a compiled function"
        except Exception:  # an object whose attributes raise: not compiled code we can see
            continue
    return ""


def _without_strings(source: str) -> str:
    """The source with comments dropped (``# torch.compile(...) later`` compiles nothing)."""
    return "\n".join(line.split("#", 1)[0] for line in source.splitlines())


def eager_while_tracked(source: str = "") -> Any | None:
    """Under the tracker's dispatch mode compiled code runs eagerly anyway; left to itself TorchDynamo would also
    note, for the code objects it met (``nn.Module``'s call and ``forward`` among them), to run them eagerly from
    then on, so models compiled before or after the cell ran uncompiled for the rest of the session. TorchDynamo's
    ``force_eager`` stance (``torch.compiler.set_stance``, PyTorch 2.6 on) runs them eagerly without compiling or
    caching anything. Returns the stance to undo with ``__exit__`` (None where nothing compiled can run, or on an
    older PyTorch)."""
    if DYNAMO_MODULE not in sys.modules and not (source and _COMPILES.search(_without_strings(source))):
        return None
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("force_eager")
    except Exception:  # a stance that cannot be set: measured as before
        return None
