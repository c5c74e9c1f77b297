"""What the decoding loop tells the estimate as it runs (:class:`LoopRecorder`): event marks, the cache's storages by
slot (``layers[3].keys``), the logits copy and scores, the cache at the end, the FLOPs of each phase."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...engine.hooks.kv_cache import kv_cache_tensors
from ...engine.scan.registry import LiveStorages
from .facts import GenerateSpec
from .loop import DecodePlan, can_jump


class LoopRecorder:
    """What the loop tells the estimate as it runs: event marks, the cache's storages by slot (``layers[3].keys``),
    the logits copy and scores, the cache at the end."""

    def __init__(self, tracer: Any, registry: LiveStorages, spec: GenerateSpec) -> None:
        self.tracer, self.registry, self.spec = tracer, registry, spec
        self.marks: dict[str, int] = {}
        self.op_rows: dict[str, int] = {}  # event -> the op log's row where it happened (for the time model)
        self.slot: dict[int, str] = {}  # serial -> slot path
        self.token_bytes: dict[int, int] = {}  # serial -> bytes per token of a 4-D cache tensor
        self.special: dict[int, tuple[str, str]] = {}
        self.cache: Any = None
        self.kv_final = 0
        self.cache_facts: tuple[str, str, int, int] = ("", "", 0, 0)
        self.logits_to_keep: bool | None = None
        self.encoder_length: int | None = None
        self.flops: list[tuple[str, int]] = []  # (event, FLOPs so far)
        self.plan: DecodePlan | None = None
        self.cache_name = ""  # a hand-written decoder's cache argument (what names its cache)
        self.replacing: list[int | None] = []  # serials the jump is about to free (a stack)
        self.replaced: dict[int, int] = {}  # serial the jump made -> the serial it stands in for
        self.cached = 0  # tokens the prefill puts in the cache (the decoder's prompt)
        self.hand_written: Any = None  # (its cache, the dimension each tensor grows along)

    def serial(self, t: torch.Tensor) -> int | None:
        try:
            entry = self.registry.get(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None
        return entry.serial if entry is not None else None

    def walk(self, cache: Any) -> None:
        if cache is None:
            return
        if not self.cache_name:  # a transformers cache is one object, grown in place; a tuple cache is not kept
            self.cache = cache
        for path, t in kv_cache_tensors(cache, self.cache_name):
            s = self.serial(t)
            if s is not None and s not in self.slot:
                self.slot[s] = path
                if t.dim() == 4 and t.shape[-2]:
                    self.token_bytes[s] = t.numel() // int(t.shape[-2]) * t.element_size()

    def event(self, what: str, obj: Any) -> None:
        n = len(self.tracer.counts.events)
        self.op_rows.setdefault(f"step{obj}" if what == "step" else what, len(self.tracer.ops))
        self.flops.append((what, sum(self.tracer.flops)))
        if what in ("prefill_start", "prefill_end", "jump_start", "jump_end", "loop_end"):
            self.marks.setdefault(what, n)
        if what == "step":
            self.marks.setdefault(f"step{obj}", n)
        elif what == "prefill_start":
            self._setup(obj)
        elif what in ("prefill_end", "decode_forward", "reorder", "jump_end"):
            if what in ("prefill_end", "decode_forward"):
                self.marks["forward_done"] = n  # the last forward's end: the loop's bookkeeping follows
                if "jump_end" not in self.marks:
                    self.marks["bookkeeping_before_jump"] = n
            self.walk(obj)
            if what == "prefill_end":
                self.marks.setdefault("decode_start", n)
                from .variants import remember_prompt

                remember_prompt(self.cache)
                plan = self.plan
                if plan is not None and plan.jump and not self.cache_name:
                    plan.jump = self.cache is not None and can_jump(self.cache)
        elif what == "prompt":
            self.cached = int(obj)
        elif what == "replacing":
            self.replacing.append(self.serial(obj))
        elif what == "replaced":
            new, old = self.serial(obj), self.replacing.pop() if self.replacing else None
            if new is not None and old is not None:
                self.replaced[new] = old
        elif what == "logits_copy":
            s = self.serial(obj)
            if s is not None:
                self.special.setdefault(s, ("other", "next-token logits (fp32 copy)"))
        elif what == "scores":
            s = self.serial(obj)
            if s is not None:
                self.special.setdefault(s, ("other", "next-token scores (logits processors)"))

    def _setup(self, model_kwargs: Any) -> None:
        if not isinstance(model_kwargs, Mapping):
            return
        self.logits_to_keep = "logits_to_keep" in model_kwargs
        enc = model_kwargs.get("encoder_outputs")
        hidden = getattr(enc, "last_hidden_state", None) if enc is not None else None
        if isinstance(hidden, torch.Tensor):
            self.encoder_length = int(hidden.shape[1])
            s = self.serial(hidden)
            if s is not None:
                self.special.setdefault(s, ("activations", "encoder outputs (kept for cross-attention)"))
        self.walk(model_kwargs.get("cache"))

    def final(self, result: Any) -> None:
        """The cache when the loop ends: its bytes (each storage once) and per-token growth."""
        self.marks.setdefault("loop_end", len(self.tracer.counts.events))
        cache = self.cache
        if cache is None:
            return
        self.walk(cache)
        if self.hand_written is not None:
            from .manual import describe_tuple_cache

            self.cache_facts = describe_tuple_cache(*self.hand_written)
        else:
            from .cache import describe_cache

            self.cache_facts = describe_cache(cache)
        seen: dict[int, int] = {}
        for _, t in kv_cache_tensors(cache, self.cache_name):
            try:
                st = t.untyped_storage()
                seen[id(st)] = int(st.nbytes())
            except (RuntimeError, NotImplementedError):
                pass
        self.kv_final = sum(seen.values())

    def phase_flops(self) -> tuple[int, int]:
        """FLOPs of the prefill and of the last decoding step (its forward and what the loop does before it)."""
        at = dict(self.flops)
        prefill = at.get("prefill_end", 0) - at.get("prefill_start", 0)
        decode = 0
        for i, (what, n) in enumerate(self.flops):
            if what == "decode_forward" and i:
                decode = n - self.flops[i - 1][1]
        return prefill, decode

    def summary(self, kind: str, batch: int, seq: int, plan: DecodePlan, model: Any) -> dict[str, Any]:
        cls, layers, per_token, fixed = self.cache_facts
        return {"kind": kind, "batch": batch, "seq": seq, "cache": cls, "layers": layers, "per_token": per_token,
                "fixed": fixed, "kv_final": self.kv_final, "steps": tuple(plan.steps_run), "jumped": plan.jumped,
                "logits_to_keep": self.logits_to_keep if kind == "transformers" else None,
                "encoder_length": self.encoder_length, "jump_ok": plan.jump, "flops": self.phase_flops(),
                "slot": dict(self.slot), "marks": dict(self.marks), "replaced": dict(self.replaced),
                "token_bytes": dict(self.token_bytes), "cached": self.cached,
                "is_encoder_decoder": bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)),
                "max_positions": _max_positions(model)}


def _max_positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(text, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None
