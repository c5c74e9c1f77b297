"""The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``, or the ``allocator_settings`` a memory snapshot
recorded) as far as they change block sizes: ``expandable_segments``, ``max_split_size_mb`` (with
``max_non_split_rounding_mb``) and ``roundup_power2_divisions``, parsed as ``AllocatorConfig::parseArgs`` parses them
(``c10/core/AllocatorConfig.cpp``; ``c10/cuda/CUDAAllocatorConfig.cpp`` before 2.8). ``caching_allocator.py``
applies them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
LARGE_BUFFER = 20 << 20  # kLargeBuffer (and an expandable segment's large page)
MIB = 1 << 20
#: roundup_power2_divisions' size intervals: 1 MiB, 2 MiB, ... 32 GiB (kRoundUpPowerOfTwoIntervals)
INTERVALS = 16


# --- settings --------------------------------------------------------------------------------------------
#: options that change what the allocator holds but are not modelled, and why
UNMODELLED = {
    "garbage_collection_threshold": "frees cached blocks early once a memory fraction is set",
    "large_segment_size_mb": "the segment size of 1-10 MiB requests",
    "backend": "another allocator (cudaMallocAsync keeps no PyTorch blocks)",
    "per_process_memory_fraction": "a cap on what the allocator reserves",
}
#: options that change nothing on the device (host memory, locking, error behaviour)
IGNORED = {"release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
           "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
           "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb", "pinned_reserve_segment_size_mb",
           "pinned_free_catch_all", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom"}


@dataclass(frozen=True)
class AllocatorSettings:
    """The caching allocator's configuration, as far as it changes block sizes. ``max_split_size``: bytes
    (``None``: unlimited, the default); ``roundup_power2_divisions``: the divisions of each of the 16 size
    intervals (empty: no power-of-two rounding); ``unmodelled``: options read that change memory but are not
    modelled; ``source``: where they were read (``"alloc_conf="``, an environment variable, the snapshot)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = ()
    garbage_collection_threshold: float = 0.0
    unmodelled: tuple[str, ...] = ()
    source: str = ""

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)`` of ``AllocatorConfig.cpp``: the divisions of ``size``'s interval."""
        table = self.roundup_power2_divisions
        if not table:
            return 0
        index = min(max(size.bit_length() - 1 - 20, 0), INTERVALS - 1)
        return table[index]

    @property
    def is_default(self) -> bool:
        return (not self.expandable_segments and self.max_split_size is None
                and self.max_non_split_rounding == LARGE_BUFFER and not any(self.roundup_power2_divisions))

    def max_remainder(self, size: int) -> int:
        """The most a block can exceed its rounded request ``size`` by when the history does not show which cached
        block served it (an unsplit remainder)."""
        if self.expandable_segments or size <= SMALL_SIZE:
            return 0
        if self.max_split_size is not None and size >= self.max_split_size:
            return self.max_non_split_rounding - MIN_BLOCK
        return SMALL_SIZE

    def describe(self) -> str:
        """The modelled settings in ``PYTORCH_CUDA_ALLOC_CONF`` syntax (``"default settings"`` when none)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MIB}")
        if any(self.roundup_power2_divisions):
            table = self.roundup_power2_divisions
            if len(set(table)) == 1:
                parts.append(f"roundup_power2_divisions:{table[0]}")
            else:
                spans = [f"{1 << i}:{d}" for i, d in enumerate(table) if i == 0 or d != table[i - 1]]
                parts.append(f"roundup_power2_divisions:[{','.join(spans)}]")
        return ",".join(parts) if parts else "default settings"

    def note(self, what: str) -> str:
        """A sentence for a report's or an estimate's notes: which settings ``what`` used, and from where."""
        where = f" (from {self.source})" if self.source else ""
        text = f"{what} with the settings {self.describe()}{where}"
        if self.unmodelled:
            text += f"; not modelled: {', '.join(self.unmodelled)}"
        return text


DEFAULT_SETTINGS = AllocatorSettings()


def _tokens(text: str) -> list[str]:
    """``ConfigTokenizer`` of ``c10/core/AllocatorConfig.h``: ``,``, ``:``, ``[`` and ``]`` are tokens of their own,
    whitespace is dropped."""
    out: list[str] = []
    word = ""
    for ch in text:
        if ch in ",:[]":
            if word:
                out.append(word)
                word = ""
            out.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        out.append(word)
    return out


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _divisions(toks: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """``parseRoundUpPower2Divisions``: ``N`` (every interval) or ``[MB:N,...,>:N]``; returns (table, next index).
    A first ``MB:N`` fills the intervals below it too; ``>:N`` fills those after the last one listed."""
    table = [0] * INTERVALS
    if toks[i] != "[":
        n = int(toks[i])
        if not power_of_two(n):
            raise ValueError(f"roundup_power2_divisions must be a power of 2, not {n}")
        return (n,) * INTERVALS, i
    first, last = True, 0
    i += 1
    while i < len(toks) and toks[i] != "]":
        key = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise ValueError("roundup_power2_divisions: expected [MB:N, ..., >:N]")
        n = int(toks[i + 2])
        if n and not power_of_two(n):
            raise ValueError(f"roundup_power2_divisions: divisions must be a power of 2 or 0, not {n}")
        if key == ">":
            table[last + 1:] = [n] * (INTERVALS - last - 1)
        else:
            mb = int(key)
            if not power_of_two(mb):
                raise ValueError(f"roundup_power2_divisions: intervals must be powers of 2 (MiB), not {mb}")
            index = min(mb.bit_length() - 1, INTERVALS - 1)
            if first:
                table[:index] = [n] * index
                first = False
            table[index] = n
            last = index
        i += 3
        if i < len(toks) and toks[i] == ",":
            i += 1
    if i >= len(toks):
        raise ValueError("roundup_power2_divisions: the list is not closed with ]")
    return tuple(table), i


def _megabytes(option: str, value: str) -> int:
    mb = int(value)
    if mb < LARGE_BUFFER // MIB:
        raise ValueError(f"{option} must be at least {LARGE_BUFFER // MIB} (PyTorch refuses smaller), not {mb}")
    return mb * MIB


def parse_alloc_conf(text: str, *, source: str = "", strict: bool = True) -> AllocatorSettings:
    """The settings a ``PYTORCH_CUDA_ALLOC_CONF`` string gives (``"expandable_segments:True,max_split_size_mb:512"``),
    parsed as ``AllocatorConfig::parseArgs`` does. ``strict``: a ``ValueError`` for an option PyTorch does not know
    (else it is listed among the unmodelled ones); malformed values always raise."""
    toks = _tokens(text or "")
    values: dict[str, Any] = {}
    unmodelled: list[str] = []
    i = 0
    while i < len(toks):
        key = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise ValueError(f"allocator settings: expected OPTION:VALUE, got {' '.join(toks[i:i + 3])!r} in {text!r}")
        value = toks[i + 2]
        i += 2
        try:
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"expandable_segments takes True or False, not {value!r}")
                values["expandable_segments"] = value == "True"
            elif key == "max_split_size_mb":
                values["max_split_size"] = _megabytes(key, value)
            elif key == "max_non_split_rounding_mb":
                values["max_non_split_rounding"] = _megabytes(key, value)
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"], i = _divisions(toks, i)
            elif key in UNMODELLED:
                if key == "garbage_collection_threshold":
                    values[key] = float(value)
                if key != "backend" or value != "native":
                    unmodelled.append(f"{key}:{value} ({UNMODELLED[key]})")
            elif key not in IGNORED:
                if strict:
                    raise ValueError(f"unknown allocator option {key!r}; the ones that change block sizes are "
                                     "expandable_segments, max_split_size_mb, max_non_split_rounding_mb and "
                                     "roundup_power2_divisions")
                unmodelled.append(f"{key}:{value} (not known here)")
        except ValueError as err:
            if "allocator" in str(err) or key in str(err):
                raise
            raise ValueError(f"allocator settings: {key}: cannot read {value!r}") from None
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise ValueError(f"allocator settings: expected ',' after {key}, got {toks[i]!r}")
            i += 1
    return AllocatorSettings(unmodelled=tuple(unmodelled), source=source, **values)


def settings_from_env(environ: Mapping[str, str] | None = None) -> AllocatorSettings:
    """What the process's allocator reads: ``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``
    (``CUDAAllocatorConfig::instance``). A value PyTorch would refuse reads as the default."""
    env = os.environ if environ is None else environ
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        text = env.get(name)
        if text:
            try:
                return parse_alloc_conf(text, source=name, strict=False)
            except ValueError:
                return DEFAULT_SETTINGS
    return DEFAULT_SETTINGS


def settings_from_snapshot(settings: Mapping[str, Any] | None) -> AllocatorSettings:
    """The settings a ``torch.cuda.memory._snapshot()`` recorded under ``"allocator_settings"``
    (``torch/csrc/cuda/Module.cpp``): ``expandable_segments`` (bool), ``max_split_size`` (bytes; ``SIZE_MAX``,
    read as -1, when unlimited), ``roundup_power2_divisions`` (``{"1": N, "2": N, "4": N, ...}``, keyed by each
    interval's start in MiB), and the settings string under ``"PYTORCH_CUDA_ALLOC_CONF"`` (for
    ``max_non_split_rounding_mb``, which the dict lacks)."""
    if not settings:
        return DEFAULT_SETTINGS
    try:
        base = parse_alloc_conf(str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""), strict=False)
    except ValueError:
        base = DEFAULT_SETTINGS
    split = settings.get("max_split_size")
    max_split = int(split) if isinstance(split, int) and 0 < split < (1 << 62) else None
    table = settings.get("roundup_power2_divisions")
    divisions = base.roundup_power2_divisions
    if isinstance(table, Mapping) and table:
        divisions = tuple(int(table.get(str(1 << i), 0)) for i in range(INTERVALS))
    elif isinstance(table, (list, tuple)) and len(table) == INTERVALS:
        divisions = tuple(int(d) for d in table)
    return replace(base, expandable_segments=bool(settings.get("expandable_segments", base.expandable_segments)),
                   max_split_size=max_split, roundup_power2_divisions=divisions if any(divisions) else (),
                   source="the allocator's snapshot")


__all__ = ["DEFAULT_SETTINGS", "IGNORED", "INTERVALS", "LARGE_BUFFER", "MIB", "MIN_BLOCK", "SMALL_SIZE",
           "UNMODELLED", "AllocatorSettings", "parse_alloc_conf", "power_of_two", "settings_from_env",
           "settings_from_snapshot"]
