"""The decoding loops of transformers' ``generate()`` (5.x: ``GenerationMixin._sample`` and ``_beam_search``),
modelled on fake tensors.

``generate()`` itself runs as it is, up to the decoding loop: its own generation config, special tokens,
attention mask (dropped when it is all ones), position ids, encoder run (encoder-decoder models), the
expansion of the inputs for beams, ``logits_to_keep=1`` where the model's forward accepts it, and the cache
object it chooses. The loop is handed in as ``custom_generate``: the functions below are the loops of
``_sample`` and ``_beam_search`` line for line, with the same tensors alive at the same moments, less the
checks that read values (``unfinished_sequences.max() == 0``, the beam search's stopping condition): they
run to ``max_new_tokens`` (``min_new_tokens=N`` makes the real loop do the same).

Every decoding step repeats the one before it with one more token in the cache. So the loop runs the
prefill (and what the loop does with its logits), then *advances* the state to the start of the last step
(the cache and the growing tensors at the lengths the real loop would have then, each old tensor freed
before its longer one is made, so the jump itself never raises the memory), and runs the last step, at the
longest cache. When a cache has a layer type whose growth is not modelled, every step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from ..fake.known_values import attach, value_of
from ..torch_private import disable_current_modes

#: model kwargs that ``_update_model_kwargs_for_generation`` grows by one token a step
GROWING_KWARGS = ("position_ids", "decoder_position_ids", "attention_mask", "decoder_attention_mask",
                  "token_type_ids", "mm_token_type_ids")


class NoJump(Exception):
    """A cache layer whose growth is not modelled: every decoding step is run instead."""


@dataclass
class DecodePlan:
    """Which decoding steps run, and what to tell the estimate after each forward and jump.

    Steps are numbered as the real loop runs its forwards: 0 is the prefill, 1 .. ``new_tokens - 1`` the
    decoding steps (the last token comes from the last step's logits)."""

    new_tokens: int
    on_event: Callable[[str, Any], None] = lambda what, cache: None
    cuda: bool = False  # a GPU is modelled (an offloading cache moves layers to the host)
    jump: bool = True
    jump_at: int = 0  # the step after which the loop jumps to the last (its bookkeeping is the last step's)
    jumped: int = 0  # tokens the jump skipped (0: every step ran)
    steps_run: list[int] = field(default_factory=list)

    @property
    def last(self) -> int:
        return self.new_tokens - 1

    def next_step(self, step: int) -> int | None:
        """The step after ``step`` (``None``: the loop ends)."""
        if step >= self.last:
            return None
        if self.jump and step == self.jump_at and self.last > self.jump_at + 1:
            return self.last
        return step + 1


def cache_of(model_kwargs: dict[str, Any]) -> Any:
    for key in ("cache", "past_key_values"):
        c = model_kwargs.get(key)
        if c is not None:
            return c
    return None


def decoding(plan: DecodePlan) -> Callable[..., Any]:
    """The ``custom_generate`` callable generate() hands its prepared inputs to."""

    def decode(model: Any, input_ids: torch.Tensor, logits_processor: Any = None, stopping_criteria: Any = None,
               generation_config: Any = None, synced_gpus: bool = False, streamer: Any = None,
               **model_kwargs: Any) -> torch.Tensor:
        prepare_cache(cache_of(model_kwargs), plan)
        if generation_config.num_beams > 1:
            return beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, plan,
                               model_kwargs)
        return sample(model, input_ids, logits_processor, stopping_criteria, generation_config, plan, model_kwargs)

    return decode


def prepare_cache(cache: Any, plan: DecodePlan) -> None:
    """An offloading cache: on a modelled GPU its layers go to the host between uses (``generate_variants``);
    on the CPU there is nowhere to offload to."""
    inner = getattr(cache, "self_attention_cache", cache)
    if not getattr(inner, "offloading", False):
        return
    if not plan.cuda:
        raise ValueError("an offloaded cache moves the cache from the GPU to the host: it needs device='cuda' (on "
                         "the CPU there is nowhere to offload to, and transformers' offloading needs CUDA)")
    from .variants import model_offloading

    model_offloading(cache)


def sample(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
           generation_config: Any, plan: DecodePlan, model_kwargs: dict[str, Any]) -> torch.Tensor:
    """``GenerationMixin._sample`` (greedy or multinomial), steps chosen by ``plan``."""
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    do_sample = generation_config.do_sample
    is_encoder_decoder = model.config.is_encoder_decoder
    batch_size = input_ids.shape[0]
    unfinished_sequences = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    plan.on_event("prompt", int(input_ids.shape[1]))
    plan.on_event("prefill_start", model_kwargs)
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    plan.on_event("prefill_end", outputs.get("cache") if hasattr(outputs, "get") else None)
    step: int | None = 0
    while step is not None:
        plan.steps_run.append(step)
        plan.on_event("step", step)
        if step > 0:
            model_inputs = model.prepare_inputs_for_generation(
                input_ids, next_sequence_length=1 if model_kwargs["use_cache"] else None, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)
            plan.on_event("decode_forward", cache_of(model_kwargs))
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                 is_encoder_decoder=is_encoder_decoder)
        next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
        plan.on_event("logits_copy", next_token_logits)
        next_token_scores = logits_processor(input_ids, next_token_logits)
        plan.on_event("scores", next_token_scores)
        if do_sample:
            probs = F.softmax(next_token_scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_token_scores, dim=-1)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, None)
        del outputs
        following = plan.next_step(step)
        if following is not None and following > step + 1:
            shape, dtype = tuple(input_ids.shape), input_ids.dtype
            plan.on_event("jump_start", None)
            plan.on_event("replacing", input_ids)
            input_ids = None  # freed before the longer one is made
            input_ids = advance(plan, shape, dtype, following - step - 1, model_kwargs)
        step = following
    plan.on_event("loop_end", None)
    return input_ids


def beam_search(model: Any, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                generation_config: Any, plan: DecodePlan, model_kwargs: dict[str, Any]) -> torch.Tensor:
    """``GenerationMixin._beam_search``, steps chosen by ``plan``: the running and finished beams, the
    top-k continuations over ``num_beams × vocabulary`` and the cache reordered after every step."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    gc = generation_config
    pad_token_id, eos_token_id = gc._pad_token_tensor, gc._eos_token_tensor
    do_sample, early_stopping, length_penalty = gc.do_sample, gc.early_stopping, gc.length_penalty
    max_length, num_beams = gc.max_length, gc.num_beams
    batch_size_unflattened, cur_len = input_ids.shape[:2]
    batch_size = batch_size_unflattened // num_beams
    decoder_prompt_len = cur_len
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
    top_num_beam_mask = torch.cat((torch.ones((num_beams), dtype=torch.bool),
                                   torch.zeros((beams_to_keep - num_beams), dtype=torch.bool)),
                                  dim=0).to(input_ids.device)
    output_fill_value = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1
    device = input_ids.device
    running_sequences = torch.full((batch_size, num_beams, max_length), fill_value=output_fill_value,
                                   dtype=torch.int64, device=device)
    running_sequences[:, :, :cur_len] = model._unflatten_beam_dim(input_ids, batch_size, num_beams)
    sequences = running_sequences.detach().clone()
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=device)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool, device=device)
    next_token_hits_stopping_criteria = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    running_beam_indices = torch.full((batch_size, num_beams, max_length - cur_len), fill_value=-1,
                                      dtype=torch.int32, device=device)
    beam_indices = running_beam_indices.detach().clone()
    flat_running_sequences = input_ids
    plan.on_event("prompt", int(input_ids.shape[1]))
    plan.on_event("prefill_start", model_kwargs)
    model_outputs = model._prefill(input_ids, gc, model_kwargs, is_first_iteration=True)
    plan.on_event("prefill_end", model_outputs.get("cache") if hasattr(model_outputs, "get") else None)
    step: int | None = 0
    while step is not None:
        plan.steps_run.append(step)
        plan.on_event("step", step)
        if step > 0:
            flat_running_sequences = model._flatten_beam_dim(running_sequences[:, :, :cur_len])
            model_inputs = model.prepare_inputs_for_generation(
                flat_running_sequences, next_sequence_length=1 if model_kwargs["use_cache"] else None,
                **model_kwargs)
            model_outputs = model(**model_inputs, return_dict=True)
            plan.on_event("decode_forward", cache_of(model_kwargs))
        model_kwargs = model._update_model_kwargs_for_generation(
            model_outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder)
        logits = model_outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=input_ids.device)
        plan.on_event("logits_copy", logits)
        log_probs = F.log_softmax(logits, dim=-1)
        log_probs = logits_processor(flat_running_sequences, log_probs)
        del model_outputs
        log_probs = model._unflatten_beam_dim(log_probs, batch_size, num_beams)
        log_probs = log_probs + running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (batch_size, -1))
        topk_log_probs, topk_running_sequences, topk_running_beam_indices = model._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len,
            do_sample=do_sample, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size)
        next_token_hits_stopping_criteria = stopping_criteria(
            model._flatten_beam_dim(topk_running_sequences[:, :, : cur_len + 1]), None)
        next_token_hits_stopping_criteria = model._unflatten_beam_dim(next_token_hits_stopping_criteria,
                                                                      batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices,
            next_token_hits_stopping_criteria=next_token_hits_stopping_criteria, num_beams=num_beams)
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences, topk_running_sequences=topk_running_sequences, beam_scores=beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished, next_token_hits_stopping_criteria=next_token_hits_stopping_criteria,
            top_num_beam_mask=top_num_beam_mask, num_beams=num_beams, cur_len=cur_len,
            decoder_prompt_len=decoder_prompt_len, length_penalty=length_penalty, early_stopping=early_stopping)
        if any(key in model_kwargs for key in ALL_CACHE_NAMES):
            key = next(k for k in ALL_CACHE_NAMES if k in model_kwargs)
            beam_idx = model._flatten_beam_dim(running_beam_indices[..., cur_len - decoder_prompt_len])
            if hasattr(model, "_reorder_cache"):
                model_kwargs[key] = model._reorder_cache(model_kwargs[key], beam_idx)
            elif hasattr(model_kwargs[key], "reorder_cache"):
                model_kwargs[key].reorder_cache(beam_idx)
            else:
                raise ValueError(f"{type(model).__name__} cannot use beam search with a cache: the cache cannot be "
                                 "reordered")
            plan.on_event("reorder", model_kwargs[key])
        cur_len = cur_len + 1
        is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
            cur_len=cur_len, max_length=max_length, decoder_prompt_len=decoder_prompt_len,
            early_stopping=early_stopping, length_penalty=length_penalty)
        following = plan.next_step(step)
        if following is not None and following > step + 1:
            skip = following - step - 1
            shape, dtype = tuple(flat_running_sequences.shape), flat_running_sequences.dtype
            plan.on_event("jump_start", None)
            plan.on_event("replacing", flat_running_sequences)
            flat_running_sequences = None
            flat_running_sequences = advance(plan, shape, dtype, skip, model_kwargs)
            cur_len += skip
        step = following
    plan.on_event("loop_end", None)
    return sequences


def advance(plan: DecodePlan, ids_shape: tuple[int, ...], ids_dtype: torch.dtype, tokens: int,
            model_kwargs: dict[str, Any]) -> torch.Tensor:
    """Skip ``tokens`` decoding steps: every growing model kwarg and the cache's self-attention layers at the
    lengths the real loop would reach, each old tensor freed before its longer one is made; returns the token
    ids at their new length (the caller has let go of the old ones)."""
    for key in GROWING_KWARGS:
        t = model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            shape, dtype = tuple(t.shape), t.dtype
            value = grown_value(key, value_of(t), tokens)
            plan.on_event("replacing", t)
            model_kwargs[key] = t = None
            model_kwargs[key] = torch.empty((*shape[:-1], shape[-1] + tokens), dtype=dtype)
            attach(model_kwargs[key], value)
            plan.on_event("replaced", model_kwargs[key])
    cache = cache_of(model_kwargs)
    if cache is not None:
        grow_cache(cache, tokens)
    ids = torch.empty((*ids_shape[:-1], ids_shape[-1] + tokens), dtype=ids_dtype)
    plan.on_event("replaced", ids)
    plan.jumped = tokens
    plan.on_event("jump_end", cache)
    return ids


def grown_value(key: str, value: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """The values ``_update_model_kwargs_for_generation`` gives a growing kwarg after ``tokens`` more steps: a
    mask gains ones, positions count on, token types repeat the last one (``mm_token_type_ids``: zeros). A
    model reads them (``mask.all()`` decides whether the mask is dropped, and with it the attention kernel)."""
    if value is None or value.dim() < 1 or value.shape[-1] == 0:
        return None
    with disable_current_modes(), torch.no_grad():
        tail_shape = (*value.shape[:-1], tokens)
        if key.endswith("attention_mask"):
            tail = value.new_ones(tail_shape)
        elif key.endswith("position_ids"):
            steps = torch.arange(1, tokens + 1, dtype=value.dtype).view(*([1] * (value.dim() - 1)), -1)
            tail = value[..., -1:] + steps
        elif key == "mm_token_type_ids":
            tail = value.new_zeros(tail_shape)
        else:
            tail = value[..., -1:].expand(tail_shape)
        return torch.cat([value, tail], dim=-1)


def can_jump(cache: Any) -> bool:
    """Whether every layer of ``cache`` is one whose growth :func:`grow_cache` models."""
    try:
        for layer in self_attention_layers(cache):
            _grower(layer)
    except NoJump:
        return False
    return True


def self_attention_layers(cache: Any) -> list[Any]:
    inner = getattr(cache, "self_attention_cache", None)  # EncoderDecoderCache: the cross-attention one is fixed
    target = inner if inner is not None else cache
    layers = getattr(target, "layers", None)
    if layers is None:
        raise NoJump(f"{type(cache).__name__} has no layers")
    return list(layers)


def grow_cache(cache: Any, tokens: int) -> None:
    for layer in self_attention_layers(cache):
        _grower(layer)(layer, tokens)


def _grower(layer: Any) -> Callable[[Any, int], None]:
    from transformers import cache_utils as cu

    from .variants import grow_quantized, is_modelled_quantized

    if type(layer).__name__ == "DummyLayer":
        return _nothing
    if is_modelled_quantized(layer):
        return grow_quantized
    if getattr(cu, "BaseQuantizedLayer", None) is not None and isinstance(layer, cu.BaseQuantizedLayer):
        raise NoJump("quantized layers")
    if getattr(cu, "DynamicIndexedLayer", None) is not None and isinstance(layer, cu.DynamicIndexedLayer):
        raise NoJump("indexed layers")
    if getattr(cu, "StaticIndexedLayer", None) is not None and isinstance(layer, cu.StaticIndexedLayer):
        raise NoJump("indexed layers")
    if isinstance(layer, cu.StaticSlidingWindowLayer):
        return _static_sliding
    if isinstance(layer, cu.StaticLayer):
        return _static
    if isinstance(layer, cu.DynamicSlidingWindowLayer):
        return _dynamic_sliding
    if type(layer) is cu.DynamicLayer or isinstance(layer, cu.DynamicLayer) and _only_kv_grows(layer):
        return _dynamic
    linear = getattr(cu, "LinearAttentionLayer", None)
    if linear is not None and isinstance(layer, linear):
        return _nothing  # fixed-size convolution and recurrent states
    raise NoJump(type(layer).__name__)


def _only_kv_grows(layer: Any) -> bool:
    """A DynamicLayer subclass that keeps nothing that grows besides ``keys`` and ``values``."""
    grows = [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and v.dim() >= 3
             and k not in ("keys", "values")]
    return not grows


def _nothing(layer: Any, tokens: int) -> None:
    return None


def _dynamic(layer: Any, tokens: int) -> None:
    """DynamicLayer: ``keys``/``values`` are ``torch.cat``'s outputs, one token longer each step."""
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return
    from .variants import host_like, is_host

    for name in ("keys", "values"):
        old = getattr(layer, name)
        shape, dtype, host = list(old.shape), old.dtype, is_host(old)
        setattr(layer, name, None)
        del old
        shape[-2] += tokens
        setattr(layer, name, host_like(shape, dtype) if host else torch.empty(shape, dtype=dtype))


def _dynamic_sliding(layer: Any, tokens: int) -> None:
    """DynamicSlidingWindowLayer after a decoding step: the last ``min(length, window - 1)`` tokens, a view of
    the ``torch.cat`` output that was one token longer than what the layer held before."""
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return
    window = layer.sliding_window
    length = layer.cumulative_length + tokens
    kept = min(length, window - 1)
    stored = min(length - 1, window - 1) + 1
    for name in ("keys", "values"):
        old = getattr(layer, name)
        shape, dtype = list(old.shape), old.dtype
        setattr(layer, name, None)
        del old
        shape[-2] = stored
        base = torch.empty(shape, dtype=dtype)
        setattr(layer, name, base[:, :, stored - kept:, :])
        del base
    layer.cumulative_length = length


def _static(layer: Any, tokens: int) -> None:
    """StaticLayer: preallocated; only its length moves."""
    if layer.is_initialized:
        layer.cumulative_length.add_(tokens)


def _static_sliding(layer: Any, tokens: int) -> None:
    if not layer.is_initialized:
        return
    before = layer.cumulative_length_int
    layer.cumulative_length_int = before + tokens
    if before < layer.max_cache_len:
        layer.cumulative_length.add_(min(tokens, layer.max_cache_len - before))


__all__ = ["GROWING_KWARGS", "NoJump", "DecodePlan", "advance", "beam_search", "can_jump", "cache_of", "decoding",
           "grow_cache", "sample", "self_attention_layers"]
