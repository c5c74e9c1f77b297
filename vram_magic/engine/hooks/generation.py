"""``generate()`` and KV-cache updates, as the tracker sees them while it measures.

While a tracker is active, transformers' cache classes (the methods that grow, reorder or crop a cache) and
``GenerationMixin.generate`` are wrapped — once, whatever the number of trackers, and put back when the last
one leaves. transformers is never imported for it: only classes already loaded are wrapped.

* Memory made inside a cache's update without grad (generate(), ``no_grad``, ``inference_mode``) is made in the
  phase ``cache update``: the cache's growth step by step (``DynamicLayer``'s ``torch.cat``, whose old tensor
  is dropped at once), a static layer's preallocation, a quantized layer's dequantized copy, a reorder's or
  crop's new tensors. It counts as KV cache, freed or not.
* Inside ``generate()``, memory is made in the phase ``prefill`` until the decode loop's first forward (the
  encoder of an encoder-decoder model, and the prompt's forward, are the prefill), then in ``decode``; each
  forward of the loop is one step (see :meth:`~vram_magic.engine.tracker.mode.Tracker.root_forward`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from ..phases import Phase

# the phases of generation (phases.py holds them all), under their old names here
PREFILL, DECODE, KV_UPDATE = Phase.PREFILL, Phase.DECODE, Phase.KV_UPDATE
CELL = Phase.CELL

_CACHE_UTILS = "transformers.cache_utils"
_GENERATION_UTILS = "transformers.generation.utils"
# the methods of a Cache that make cache memory (growth, preallocation, reorders, crops, offloading's copies)
_CACHE_METHODS = ("update", "update_conv_state", "update_recurrent_state", "update_indexer", "early_initialization",
                  "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop", "offload", "prefetch")
# generate()'s own functions that run the prompt: a model forward called from them is the prefill (``_prefill``,
# and the encoder's run: ``_prepare_encoder_decoder_kwargs_for_generation``, ``_prepare_text_encoder_...`` in 5.x)
_PREFILL_WORDS = ("prefill", "encoder")
_WRAPPED = "__vram_magic_wrapped__"

_watchers: list[Any] = []  # the active trackers, innermost last
_patched: list[tuple[type, str, Any, Any]] = []  # (class, name, original, wrapper)
_done: list[tuple[int, int]] = [(0, 0)]  # ids of the two modules when they were last wrapped
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def watch(tracker: Any) -> None:
    """Let ``tracker`` hear of cache updates and generate() calls (wraps what is loaded, if not yet wrapped)."""
    if tracker not in _watchers:
        _watchers.append(tracker)
    wrap_loaded()


def unwatch(tracker: Any) -> None:
    """Stop telling ``tracker``; the last tracker to leave puts every wrapped method back."""
    if tracker in _watchers:
        _watchers.remove(tracker)
    if not _watchers:
        _unwrap_all()


def wrap_loaded() -> None:
    """Wrap the cache classes and generate() of a transformers loaded since (cheap when nothing is new)."""
    if not _watchers:
        return
    loaded = (id(sys.modules.get(_CACHE_UTILS)), id(sys.modules.get(_GENERATION_UTILS)))
    if loaded == _done[0]:
        return  # nothing loaded since the last time (this runs at every model's forward)
    _done[0] = loaded
    cache_utils = sys.modules.get(_CACHE_UTILS)
    base = getattr(cache_utils, "Cache", None) if cache_utils is not None else None
    if isinstance(base, type):
        for cls in _subclasses(base):
            for name in _CACHE_METHODS:
                _wrap(cls, name, _cache_wrapper)
    gen = sys.modules.get(_GENERATION_UTILS)
    mixin = getattr(gen, "GenerationMixin", None) if gen is not None else None
    if isinstance(mixin, type):
        _wrap(mixin, "generate", _generate_wrapper)


def _subclasses(base: type) -> list[type]:
    out, stack, seen = [], [base], set()
    while stack:
        cls = stack.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        out.append(cls)
        try:
            stack.extend(cls.__subclasses__())
        except TypeError:
            pass
    return out


def _wrap(cls: type, name: str, make: Any) -> None:
    fn = cls.__dict__.get(name)
    if fn is None or not callable(fn) or getattr(fn, _WRAPPED, False):
        return
    wrapper = make(fn)
    setattr(wrapper, _WRAPPED, True)
    try:
        setattr(cls, name, wrapper)
    except (TypeError, AttributeError):
        return
    _patched.append((cls, name, fn, wrapper))


def _unwrap_all() -> None:
    _done[0] = (0, 0)
    while _patched:
        cls, name, original, wrapper = _patched.pop()
        if cls.__dict__.get(name) is wrapper:  # someone else's patch on top stays, and so does ours under it
            setattr(cls, name, original)


def is_wrapped(cls: type, name: str) -> bool:
    """``cls.name`` is one of the wrappers (for tests: none is left once no tracker is active)."""
    return bool(getattr(cls.__dict__.get(name), _WRAPPED, False))


def _cache_wrapper(fn: Any) -> Any:
    @functools.wraps(fn)
    def cache_method(*args: Any, **kwargs: Any) -> Any:
        watchers = list(_watchers)
        if not watchers or _is_compiling():
            return fn(*args, **kwargs)
        saved = [t.enter_cache_update() for t in watchers]
        try:
            return fn(*args, **kwargs)
        finally:
            for t, s in zip(watchers, saved):
                t.leave_stage(s)

    return cache_method


def _generate_wrapper(fn: Any) -> Any:
    @functools.wraps(fn)
    def generate(*args: Any, **kwargs: Any) -> Any:
        watchers = list(_watchers)
        if not watchers or _is_compiling():
            return fn(*args, **kwargs)
        saved = [t.generation_begins() for t in watchers]
        try:
            return fn(*args, **kwargs)
        finally:
            for t, s in zip(watchers, saved):
                t.generation_ends(s)

    return generate


# id(code) -> (True: a prefill function, False: another function of generate's, None: neither; the code)
_kinds: dict[int, tuple[bool | None, Any]] = {}


def _code_kind(code: Any) -> bool | None:
    hit = _kinds.get(id(code))
    if hit is not None and hit[1] is code:
        return hit[0]
    gen = sys.modules.get(_GENERATION_UTILS)
    path = getattr(gen, "__file__", None)
    kind: bool | None = None
    if path and code.co_filename == path:
        kind = any(word in code.co_name for word in _PREFILL_WORDS)
    if len(_kinds) > 10_000:
        _kinds.clear()
    _kinds[id(code)] = (kind, code)
    return kind


def is_prefill_forward(frame: Any, limit: int = 40) -> bool:
    """A model forward called (``frame`` up) from generate()'s prefill or its encoder run, rather than from its
    decode loop: the innermost of generate()'s own functions on the stack says which."""
    n = 0
    while frame is not None and n < limit:
        kind = _code_kind(frame.f_code)
        if kind is not None:
            return kind
        frame = frame.f_back
        n += 1
    return True  # no function of generate's found: a forward of its own kind (the first one is the prefill)


class GenerationStages:
    """The tracker's part in this: the stage memory made now is in, kept as ``now.stage`` (0: the tracker's usual
    rules), which generate()'s and the caches' wrappers set, and the stages a block went through (``steps``: where
    each stage began in the counts' history)."""

    def __init__(self, now: Any, counts: Any) -> None:
        self.now = now
        self.counts = counts
        self.generating = 0  # generate() calls under way
        self.gen_step = 0  # the decode step under way (0: the prefill, or none)
        # (event index, PREFILL or DECODE, or CELL where a call ended, step): where each stage began
        self.steps: list[tuple[int, int, int]] = []

    def root_forward(self) -> None:
        """A forward with no module's forward around it: inside generate(), the prefill's or a decode step's."""
        if _CACHE_UTILS in sys.modules:
            wrap_loaded()  # transformers imported inside the block
        if not self.generating:
            return
        now = self.now
        if is_prefill_forward(sys._getframe(1)):
            if now.stage != PREFILL:  # a decode loop that runs a prefill again (assisted decoding)
                now.stage = PREFILL
                self.steps.append((len(self.counts.events), PREFILL, self.gen_step))
            return
        self.gen_step += 1
        now.stage = DECODE
        self.steps.append((len(self.counts.events), DECODE, self.gen_step))

    def enter_cache_update(self) -> int:
        """Memory made from here on is the cache's, where no autograd graph can save it: under grad (a training
        forward with ``use_cache=True``) the cache's new tensors are also what attention saves for backward, and
        stay activations unless a kept cache holds them at the end."""
        saved = self.now.stage
        if not torch.is_grad_enabled():
            self.now.stage = KV_UPDATE
        return saved

    def leave_stage(self, saved: int) -> None:
        self.now.stage = saved

    def generation_begins(self) -> tuple[int, int]:
        saved = (self.now.stage, self.gen_step)
        self.generating += 1
        self.now.stage = PREFILL
        self.gen_step = 0
        self.steps.append((len(self.counts.events), PREFILL, 0))
        return saved

    def generation_ends(self, saved: tuple[int, int]) -> None:
        self.generating = max(self.generating - 1, 0)
        self.now.stage, self.gen_step = saved
        self.steps.append((len(self.counts.events), self.now.stage or CELL, self.gen_step))


__all__ = ["DECODE", "KV_UPDATE", "PREFILL", "GenerationStages", "is_prefill_forward", "is_wrapped", "unwatch",
           "watch", "wrap_loaded"]
