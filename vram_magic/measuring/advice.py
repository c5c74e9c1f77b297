"""Ranked, concrete suggestions from a measured split. Pure: a function of the report's numbers."""

from __future__ import annotations

import re

from ..core.units import format_bytes
from .report import Advice, CellReport

MIN_SAVING = 1024**2  # below this, a suggestion is noise
PRESSURE = 0.8  # the strategies for a big split apply when the peak reaches this share of the capacity


def advise(report: CellReport) -> list[Advice]:
    """Suggestions for ``report``, largest saving first; empty for a healthy cell."""
    out: list[Advice] = []
    out += _leaks(report)
    out += _kept_caches(report)
    if report.oom is not None or (report.capacity and report.peak.total >= PRESSURE * report.capacity):
        out += _pressure(report)
        out += _cache_pressure(report)
    out += _fragmentation(report)
    return sorted((a for a in out if a.saving >= MIN_SAVING or a.kind in ("fragmentation", "oom")),
                  key=lambda a: -a.saving)


def _leaks(report: CellReport) -> list[Advice]:
    after = report.after
    out = []
    phases = report.trace.phases() if report.trace is not None else {}
    did_backward = "backward" in phases
    inference = any(p in phases for p in ("inference", "prefill", "decode")) and not did_backward \
        and "optimizer" not in phases
    graphs: dict[str, list[tuple[str, int]]] = {}  # root variable -> [(name, bytes)]: lists of losses group
    acts = after.details("activations")
    for label, n in acts.items():
        if label.startswith("graph held by "):
            name = label[len("graph held by "):]
            n += acts.get(name, 0)  # `del` frees the variable's own tensor too
            graphs.setdefault(re.split(r"[\[.]", name, maxsplit=1)[0], []).append((name, n))
    eval_hint = "; for evaluation run the forward under `torch.no_grad()` or `torch.inference_mode()`"
    for root, held in graphs.items():
        total = sum(n for _, n in held)
        if len(held) == 1 and held[0][0] == root:
            fix = f"`del {root}` when done, or keep `{root}.item()` / `{root}.detach()` instead of the tensor"
            title = f"`{root}` keeps an autograd graph alive"
        else:
            fix = (f"{len(held)} tensors in `{root}` each keep a graph: store `.item()` or `.detach()` instead, "
                   f"and `del` or clear `{root}` to release what it holds now")
            title = f"`{root}` holds {len(held)} tensors that keep autograd graphs alive"
        if not did_backward:
            fix += eval_hint
        out.append(Advice(title, fix + ".", total, root, "graph"))
    for label, n in after.details("other").items():
        if label.startswith("output cache "):
            name = label[len("output cache "):]
            out.append(Advice(
                f"IPython's output cache `{name}` holds tensors",
                f"`del {name}` (and `Out.clear()`), or end the cell with `;` so its value is not cached.",
                n, name, "output-cache"))
    if after.gradients and inference:
        holders = ", ".join(after.details("gradients")) or "the model"
        out.append(Advice(
            "gradients stay allocated while this cell does not train",
            f"call `optimizer.zero_grad(set_to_none=True)` (or `{holders}.zero_grad(set_to_none=True)`) after "
            "the step, and evaluate under `torch.no_grad()`.",
            after.gradients, holders, "gradients"))
    return out


def _kept_caches(report: CellReport) -> list[Advice]:
    """A KV cache left alive after the cell: a generate() output kept whole, a decoder's cache variable."""
    holders: dict[str, int] = {}
    for label, n in report.after.details("kv_cache").items():
        root = re.split(r"[\[.]", label, maxsplit=1)[0]
        if root.isidentifier():
            holders[root] = holders.get(root, 0) + n
    out = []
    generated = "prefill" in (report.trace.phases() if report.trace is not None else {})
    for root, n in holders.items():
        fix = f"`del {root}` when done"
        if generated:
            fix += (f", keep only `{root}.sequences`, or call generate() without `return_dict_in_generate=True` "
                    "(it then returns the tokens alone and drops the cache when it returns)")
        out.append(Advice(f"the KV cache of `{root}` holds {format_bytes(n)}", fix + ".", n, root, "kv-cache"))
    return out


def _cache_pressure(report: CellReport) -> list[Advice]:
    """The KV cache is a large share of the peak: a quantized or offloaded cache, a static one."""
    peak = report.oom.live if report.oom is not None else report.peak
    kv = peak["kv_cache"]
    if kv / max(peak.total, 1) < 0.25:
        return []
    return [
        Advice("the KV cache dominates: a quantized cache",
               "`model.generate(..., cache_implementation=\"quantized\", cache_config={\"backend\": \"quanto\", "
               "\"nbits\": 4})` keeps the cache in 4 bits (the last 128 tokens in full precision); rough saving "
               "shown for a 16-bit cache; quality drops a little, decoding slows.",
               kv * 3 // 4, "", "kv-quantized"),
        Advice("the KV cache dominates: an offloaded cache",
               "`cache_implementation=\"offloaded\"` keeps each layer's cache on the CPU and brings back one layer "
               "at a time (slower: every step copies the whole cache over the bus); on a GPU only. All but the "
               "layers in flight leave the GPU: the saving shown is a cautious half.",
               kv // 2, "", "kv-offloaded"),
        Advice("the KV cache dominates: a shorter context or a smaller batch",
               "the cache grows linearly with batch × (prompt + new tokens); a static cache "
               "(`cache_implementation=\"static\"`) allocates it once at its full length, so it never grows by "
               "copies, but it is as large from the first step.",
               kv // 2, "", "kv-context"),
    ]


def _pressure(report: CellReport) -> list[Advice]:
    peak = report.oom.live if report.oom is not None else report.peak
    total = max(peak.total, 1)
    model = next(iter(peak.details("parameters")), "the model")
    out = []
    act = peak.activations
    if act / total >= 0.3:
        out.append(Advice(
            "activations dominate: activation checkpointing",
            f"wrap blocks of `{model}` in `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; "
            "keeps only block inputs and recomputes the rest in backward (~30 % more compute). Rough "
            "saving shown; `%vram_estimate` gives it for this model.",
            int(act * 0.6), model, "checkpointing"))
        out.append(Advice(
            "activations dominate: bf16 autocast",
            "run the forward under `torch.autocast(device_type, dtype=torch.bfloat16)`: activations "
            "stored in 16 bits take half the space.",
            act // 2, model, "amp"))
        out.append(Advice(
            "activations dominate: halve the batch and accumulate gradients",
            "use half the batch and call `optimizer.step()` every 2 batches (scale the loss by 1/2); "
            "activations scale with the batch size.",
            act // 2, model, "batch"))
    opt = peak.optimizer_state
    if opt / total >= 0.25:
        holder = next(iter(peak.details("optimizer_state")), "the optimizer")
        out.append(Advice(
            "optimizer state dominates: a lighter optimizer or sharding",
            f"`{holder}`: Adam/AdamW keep two states per parameter; SGD with momentum keeps one (saves "
            "half), plain SGD none; ZeRO-1/FSDP over N GPUs keeps 1/N of it on each.",
            opt // 2, holder, "optimizer"))
    grads = peak.gradients
    if grads / total >= 0.25 and report.oom is not None:
        out.append(Advice(
            "gradients are a large share",
            "ZeRO-2/FSDP shard gradients over GPUs; bf16 parameters halve them.",
            grads // 2, model, "gradients"))
    if report.oom is not None:
        owned = {*peak.details("parameters"), *peak.details("gradients"), *peak.details("optimizer_state")}
        variables = [(name, n) for name, n in report.oom.holders if name not in owned]
        for name, n in variables[:2]:
            local = " in " in name  # a function's local: gone with the failed call's frames
            out.append(Advice(
                f"`{name}` held {format_bytes(n)} when memory ran out",
                f"free it before the failing line (`del {name.split(' in ')[0]}`), keep it on the CPU, or make "
                "it smaller" + ("; as a local it was released with the failed call." if local else "."),
                n, name, "holder"))
    if report.oom is not None and report.oom.requested:
        free = (report.oom.capacity or 0) - report.oom.live.total
        where = {"forward": " in the forward pass: activations grow with the batch (and sequence), so a smaller "
                            "batch with gradient accumulation, bf16 autocast or checkpointing shrink it",
                 "backward": " in backward: gradients of activations grow with the batch; a smaller batch or "
                             "activation checkpointing shrink them",
                 "optimizer": " in the optimizer step: a lighter optimizer or `foreach=False` avoids "
                              "whole-model temporaries",
                 "prefill": " in generate()'s prefill: its intermediates grow with batch × prompt length; a "
                            "shorter prompt, a smaller batch or chunked prefill (`prefill_chunk_size=`) shrink them",
                 "decode": " in a decode step: the KV cache grows with every token; fewer new tokens, a smaller "
                           "batch or a quantized or offloaded cache leave room",
                 "cache update": " while the KV cache grew: fewer new tokens, a smaller batch or a quantized or "
                                 "offloaded cache leave room"}.get(report.oom.phase, "")
        out.append(Advice(
            "the failing request",
            f"{format_bytes(report.oom.requested)} was asked for with {format_bytes(max(free, 0))} free{where}.",
            0, "", "oom"))
    return out


def _fragmentation(report: CellReport) -> list[Advice]:
    stats = report.stats
    if stats is None or stats.reserved is None or not stats.reserved:
        return []
    cached = stats.reserved - stats.allocated
    if cached < 256 * 1024**2 or cached < 0.3 * stats.reserved:
        return []
    return [Advice(
        "reserved far above allocated (fragmentation or cache)",
        f"{format_bytes(cached)} is reserved by PyTorch's cache but holds no tensor. Set "
        "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` before the first CUDA call, or "
        "`torch.cuda.empty_cache()` to hand it back (others on the GPU then see it free).",
        cached, "", "fragmentation")]
