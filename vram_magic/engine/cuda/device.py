"""CUDA specifics: which device, the allocator's counters and history around a cell, ``--budget``.

Everything that only a GPU can answer lives here, so the rest of the engine is shared with the CPU. Two rules
hold throughout:

* **Looking never initialises CUDA.** ``torch.cuda.current_device()``, ``mem_get_info``,
  ``get_device_properties`` and turning on the memory history all initialise CUDA (and the first two create a
  context, a few hundred MiB, on the device); a kernel that initialised CUDA cannot use it in forked workers. So
  nothing here calls them unless ``torch.cuda.is_initialized()`` — and ``mem_get_info`` only on a device that
  already has a context. Otherwise the figures say "not initialised".
* **One unit: the allocator's blocks.** ``memory_allocated`` counts blocks (requests rounded to 512 bytes, plus
  unsplit remainders); the history's entries carry requested sizes and are converted (``cuda_history``).

The thin part that calls PyTorch is :class:`CudaCell`; what it computes from the dicts PyTorch returns is in
plain functions (:func:`device_usage`, :func:`budget_plan`, ``cuda_history``, ``cuda_oom``), tested on the
shapes PyTorch's source emits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.device_stats import DeviceStats
from ...core.units import format_bytes
from ..torch_private import (
    cuda_has_primary_context,
    cuda_history_enabled,
    default_device_context,
    memory_snapshot,
    record_memory_history,
    set_record_memory_history,
)
from .alloc_conf import settings_from_env
from .oom_message import parse_oom_message, requested_bytes
from .usage import DeviceUsage, device_usage, touched

#: entries of the history the engine records itself (about three per tensor: alloc, free requested, completed)
HISTORY_ENTRIES = 300_000


# --- state that can be read without initialising anything -------------------------------------------------
def initialized() -> bool:
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def has_context(index: int) -> bool:
    """Whether ``cuda:index`` already has a (primary) context; asking creates none."""
    if not initialized():
        return False
    probe = cuda_has_primary_context()
    if probe is None:
        return False
    try:
        return bool(probe(index))
    except Exception:
        return False


def allocator_backend() -> str:
    """``native`` (the caching allocator), ``cudaMallocAsync``, or what a pluggable allocator calls itself."""
    try:
        return str(torch.cuda.get_allocator_backend())
    except Exception:
        return "native"


def _current_index() -> int:
    """The current device if CUDA is initialised; else the index a ``set_default_device("cuda:N")`` names, else 0
    (what CUDA will pick)."""
    if initialized():
        try:
            return int(torch.cuda.current_device())
        except Exception:
            return 0
    try:  # torch.get_default_device() would make a tensor to learn an unindexed device's index
        context = default_device_context()
        device = getattr(context, "device", None)
        if device is not None and device.type == "cuda" and device.index is not None:
            return int(device.index)
    except Exception:
        pass
    return 0


def device_count() -> int:
    """The visible CUDA devices, counted the way that initialises nothing: ``torch.cuda.device_count()`` asks NVML
    while CUDA is not initialised (PyTorch falls back to the runtime only where NVML fails). Never
    ``torch.cuda.is_available()``: it calls ``cudaGetDeviceCount``, which runs ``cuInit`` and leaves the process
    unable to use CUDA in forked children (``--ranks``, DataLoader workers), unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. 0 on a build without CUDA."""
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def resolve_device(device: Any = None, *, what: str = "device") -> str:
    """``None`` → the current CUDA device if there is one, else ``cpu``. Returns ``cpu`` or ``cuda:N``; a
    ``ValueError`` naming ``what`` (``"device"``, ``"%vram watch: device"``) for anything else."""
    if device is None:
        return f"cuda:{_current_index()}" if device_count() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown {what} {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from err
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"{what} {device!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    count = device_count()
    if not count:
        hint = "--device cpu" if what == "device" else "cpu"
        raise ValueError(f"{what} {device!r} asked for, but CUDA is not available here; use {hint}")
    index = _current_index() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"{what} {device!r} does not exist: this machine has {count} GPU(s)")
    return f"cuda:{index}"


def _index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def raw_stats(index: int) -> dict[str, Any]:
    """``torch.cuda.memory_stats(index)``: ``{}`` while CUDA is not initialised (PyTorch returns it so itself);
    reading it never creates a context."""
    if not initialized():
        return {}
    try:
        return dict(torch.cuda.memory_stats(index))
    except Exception:
        return {}


def stats_from(device: str, stats: Mapping[str, Any], free_total: tuple[int, int] | None,
               total: int | None = None) -> DeviceStats:
    """A :class:`DeviceStats` from a ``memory_stats()`` dict and the driver's ``(free, total)`` if known."""
    free = total_ = None
    if free_total is not None:
        free, total_ = int(free_total[0]), int(free_total[1])
    return DeviceStats(
        device=device,
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        total=total_ if total_ is not None else total,
        free=free,
        inactive_split=int(stats.get("inactive_split_bytes.all.current", 0)),
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
    )


def device_stats(device: str) -> DeviceStats | None:
    """Allocator statistics and the driver's free/total for ``cuda:N``; ``None`` while CUDA is not initialised.
    Free memory is read only where a context exists (reading it elsewhere would create one)."""
    if not initialized():
        return None
    index = _index(device)
    free_total = None
    if has_context(index):
        try:
            free_total = torch.cuda.mem_get_info(index)
        except Exception:
            free_total = None
    return stats_from(device, raw_stats(index), free_total, capacity(device))


def capacity(device: str) -> int | None:
    """The device's total memory; ``None`` on the CPU and while CUDA is not initialised."""
    if not device.startswith("cuda") or not initialized():
        return None
    try:
        return int(torch.cuda.get_device_properties(_index(device)).total_memory)
    except Exception:
        return None


def not_initialised_note(device: str) -> str:
    return (f"CUDA is not initialised in this process: nothing is allocated on {device} yet (vram_magic does not "
            "initialise CUDA or create a context just to look)")


def peak_if_risen(before: DeviceStats | None, after: DeviceStats | None) -> int | None:
    """The allocator's peak during the cell without resetting the user's peak counter.

    If the global peak rose during the cell, the new global peak *is* the cell's peak. If it did not, the
    cell's peak is somewhere at or below it and only the trace can tell (``None``).
    """
    if before is None or after is None or before.peak_allocated is None or after.peak_allocated is None:
        return None
    if after.peak_allocated > before.peak_allocated:
        return after.peak_allocated
    return None


# --- --budget on CUDA ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetPlan:
    """What ``--budget`` does to the allocator of one device: set ``fraction`` and put ``restore`` back after the
    cell (both ``None``: the allocator is left alone and only the tracker enforces the budget); ``notes``."""

    fraction: float | None
    restore: float | None
    notes: tuple[str, ...] = ()


def budget_plan(budget: int, total: int, reserved: int, previous: float | None, backend: str,
                gc_threshold: float = 0.0) -> BudgetPlan:
    """``previous``: the user's own fraction from ``get_per_process_memory_fraction`` (``None`` where PyTorch has
    no such getter, before 2.6: then the user's fraction could not be put back, and it is not touched).
    ``gc_threshold``: the ``garbage_collection_threshold`` of the allocator's settings.

    The fraction caps what the allocator *reserves* from the device, checked when it needs a new segment; blocks
    already cached are reused without a check, so a cache above the budget at the start lets the cell go past it
    (the tracker still checks the budget against live tensors).

    Setting a fraction turns on the allocator's ``set_fraction`` flag for good (``setMemoryFraction`` in
    ``CUDACachingAllocator.cpp``; putting 1.0 back leaves it on), and with it ``garbage_collection_threshold``'s
    collection of cached blocks. A user whose fraction reads 1.0 has most likely never set one: with a threshold
    configured, limiting the allocator for one cell would change it for the rest of the session, so it is not
    limited."""
    notes: list[str] = []
    if previous is None:
        return BudgetPlan(None, None, (
            "--budget is enforced on live tensors only on this PyTorch (it cannot read your allocator fraction "
            "before 2.6 to put it back, so the allocator itself is not limited)",))
    if backend == "native" and gc_threshold > 0 and previous >= 1.0:
        return BudgetPlan(None, None, (
            f"--budget is enforced on live tensors only: your garbage_collection_threshold:{gc_threshold:g} starts "
            "collecting cached blocks once a memory fraction is set, and PyTorch cannot unset one, so limiting the "
            "allocator for this cell would change it for the rest of the session",))
    fraction = min(budget / total, previous, 1.0)
    if backend == "native" and reserved > budget:
        notes.append(f"PyTorch's allocator already reserves {format_bytes(reserved)}, more than the "
                     f"{format_bytes(budget)} budget: its cached blocks are reused without the limit (the budget is "
                     "still checked against live tensors)")
    return BudgetPlan(fraction, previous, tuple(notes))


# --- the thin part that calls PyTorch ------------------------------------------------------------------------
@dataclass
class CudaCell:
    """The CUDA side of one measured cell: call :meth:`start` before it and :meth:`stop` after it (``stop`` never
    raises and may be called twice). Then ``usage`` (device → :class:`DeviceUsage`, every device the cell
    touched and the measured one), ``peak`` and ``before``/``after`` of the measured device, ``oom_request`` and
    ``notes``."""

    device: str
    budget: int | None = None
    history_entries: int = HISTORY_ENTRIES
    backend: str = ""
    initialised_at_start: bool = False
    history: str | None = None
    usage: dict[str, DeviceUsage] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    oom_request: int | None = None
    _before: dict[int, dict[str, Any]] = field(default_factory=dict)
    _contexts: set[int] = field(default_factory=set)
    _restore_fraction: float | None = None
    _patched: Any = None
    _user_switched: list[Any] = field(default_factory=list)
    _running: bool = False

    @property
    def index(self) -> int:
        return _index(self.device)

    def start(self) -> CudaCell:
        self._running = True
        try:
            return self._start()
        except BaseException:
            self.stop()  # whatever was changed before the failure is put back
            raise

    def _start(self) -> CudaCell:
        self.backend = allocator_backend()
        count = device_count()
        if self.budget is not None and not initialized():
            # the allocator's limit must be set before the cell allocates: --budget initialises the measured device
            torch.cuda.init()
            self.notes.append(f"--budget initialised CUDA on {self.device} before the cell ran (its allocator is "
                              "limited before the cell allocates)")
        self.initialised_at_start = initialized()
        if not self.initialised_at_start:
            return self
        self._before = {i: raw_stats(i) for i in range(count)}
        if self.budget is not None:
            self._limit()
        self._contexts = {i for i in range(count) if has_context(i)}  # after --budget, which may have made one
        self._start_history()
        return self

    def _limit(self) -> None:
        index = self.index
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = None
        if getter is not None:
            try:
                with torch.cuda.device(index):
                    previous = float(getter(index))
            except Exception:
                previous = None
        total = capacity(self.device) or 0
        reserved = int(self._before.get(index, {}).get("reserved_bytes.all.current", 0))
        if not total:
            return
        plan = budget_plan(self.budget or 0, total, reserved, previous, self.backend,
                           settings_from_env().garbage_collection_threshold)
        self.notes.extend(plan.notes)
        if plan.fraction is not None:
            # under the device's guard: releases whose setMemoryFraction calls SetDevice(device) and never
            # restores it would send the user's later device="cuda" tensors to this device
            with torch.cuda.device(index):
                torch.cuda.set_per_process_memory_fraction(plan.fraction, index)
            self._restore_fraction = plan.restore

    def _start_history(self) -> None:
        if self.backend != "native":
            self.notes.append(f"the {self.backend} allocator keeps no allocation history: the cell's peak comes from "
                              "its counters (the driver's high-water mark when it rose during the cell)")
            return
        try:
            if cuda_history_enabled():
                self.history = "user"  # theirs: read, never changed
                return
        except Exception:
            pass
        record = record_memory_history()
        try:
            try:  # no stacks: the replay reads sizes and addresses only
                record(enabled="all", context=None, stacks="python", max_entries=self.history_entries,
                       clear_history=True)
            except TypeError:
                record(enabled="all", context=None, stacks="python", max_entries=self.history_entries)
        except RuntimeError as err:
            self.notes.append(f"the allocator's history could not be recorded ({err}): the cell's peak comes from "
                              "the counters")
            return
        self.history = "ours"
        switched = self._user_switched

        def watched(*args: Any, **kwargs: Any) -> Any:
            switched.append(args[0] if args else kwargs.get("enabled", "all"))
            return record(*args, **kwargs)

        self._patched = record
        set_record_memory_history(watched)

    def stop(self) -> None:
        """Put back what :meth:`start` changed (history, fraction) and read the cell's figures. Never raises."""
        if not self._running:
            return
        self._running = False
        snapshot = None
        try:
            if self._patched is not None:
                set_record_memory_history(self._patched)
            if self.history is not None:
                try:
                    snapshot = memory_snapshot()
                except Exception as err:
                    self.notes.append(f"the allocator's history could not be read ({type(err).__name__}: {err})")
            if self.history == "ours":
                if self._user_switched:
                    if self._user_switched[-1] in (None, False):
                        self.notes.append("the cell switched the memory history off: the cell's peak comes from "
                                          "the counters for what followed")
                    else:
                        self.notes.append("the cell turned on memory-history recording itself: it is left on")
                else:
                    self._patched(enabled=None)
        except Exception as err:
            self.notes.append(f"the allocator's history could not be switched off ({type(err).__name__}: {err})")
        finally:
            self._patched = None
            self._unlimit()
        try:
            self._read(snapshot)
        except Exception as err:
            self.notes.append(f"the allocator's figures could not be read ({type(err).__name__}: {err})")

    def _unlimit(self) -> None:
        if self._restore_fraction is None:
            return
        try:
            with torch.cuda.device(self.index):
                torch.cuda.set_per_process_memory_fraction(self._restore_fraction, self.index)
        except Exception as err:
            self.notes.append(f"your allocator fraction could not be put back ({type(err).__name__}: {err})")
        finally:
            self._restore_fraction = None

    def _read(self, snapshot: Mapping[str, Any] | None) -> None:
        if not initialized():
            self.notes.append(not_initialised_note(self.device))
            return
        for i in range(device_count()):
            device = f"cuda:{i}"
            after = raw_stats(i)
            before = self._before.get(i) if self.initialised_at_start else None
            if before is None and device != self.device and not int(after.get("allocated_bytes.all.peak", 0)):
                continue  # initialised by the cell, never used
            usage, _ = device_usage(device, before, after, snapshot, history=self.history)
            if usage.touched or device == self.device:
                self.usage[device] = usage
                self.notes.extend(usage.notes)
            if device == self.device and usage.oom is not None:
                self.oom_request = usage.oom
            if i not in self._contexts and has_context(i):
                self.notes.append(f"this cell created the CUDA context on {device} (CUDA's own memory for it and its "
                                  "libraries lies outside PyTorch's allocator: nvidia-smi counts it, "
                                  "memory_allocated does not)")
        others = [u for d, u in self.usage.items() if d != self.device and u.touched]
        for u in sorted(others, key=lambda u: -u.peak):
            self.notes.append(f"this cell also used {u.device}: {format_bytes(u.before)} before, peak "
                              f"{format_bytes(u.peak)}, {format_bytes(u.after)} after (allocator counters; measure it "
                              f"with --device {u.device} for the split by category)")
        mine = self.usage.get(self.device)
        if others and mine is not None and not mine.touched:
            self.notes.append(f"{self.device}, measured by default, was not used by this cell")

    # --- results of the measured device -------------------------------------------------------------------
    @property
    def peak(self) -> int | None:
        u = self.usage.get(self.device)
        return u.peak if u is not None else None

    @property
    def before(self) -> int | None:
        u = self.usage.get(self.device)
        return u.before if u is not None else None


def oom_requested(message: str, traced: int | None) -> tuple[int | None, str]:
    """The failed request of a CUDA out-of-memory error: the history's ``oom`` entry if there is one, else what
    the message tells (with a note when that is a range)."""
    if traced is not None:
        return traced, ""
    parsed = parse_oom_message(message)
    if parsed is None:
        return None, ""
    if parsed.segment is None:
        return parsed.requested, ""
    return parsed.requested, parsed.describe()


__all__ = ["BudgetPlan", "CudaCell", "DeviceUsage", "allocator_backend", "budget_plan", "capacity", "device_count",
           "device_stats", "device_usage", "has_context", "initialized", "oom_requested", "peak_if_risen",
           "requested_bytes", "resolve_device", "stats_from", "touched"]
