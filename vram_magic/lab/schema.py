"""The JSON the JupyterLab extension passes along, written once: a kernel's figures file (:class:`Figures`, written by
:mod:`.figures` inside the kernel, read by the server) and the answer of ``GET {base_url}vram-magic/kernels``
(:class:`KernelsReply`, made by :mod:`.collect`, read by the front end).

The writers build these dicts, the server checks each figures file against :class:`Figures` before it uses one
(:func:`problems`), and the front end's types, ``labextension/src/schema.ts``, are generated from this module by
``python scripts/lab_types.py`` (``tests/lab/test_figures.py`` fails when the committed file is not what it makes).
A comment after a field goes into the TypeScript with it. Every key is always present (``None`` where unknown).
"""

from __future__ import annotations

import types
from functools import cache
from typing import Any, Literal, TypedDict, Union, get_args, get_origin, get_type_hints, is_typeddict

FORMAT = 2  # of the figures file: a server reads the files of its own format only
FOLDER = "vram-magic"  # the figures files' folder, beside the kernels' connection files
ROUTE = ("vram-magic", "kernels")  # the route's path under the server's base URL


class OwnDevice(TypedDict):
    """A CUDA device that has a context in the kernel, as the kernel's PyTorch counts it."""

    device: str  # the kernel's name for it ("cuda:0")
    uuid: str  # PyTorch's uuid of the device ("" where it has none)
    allocated: int  # bytes in tensors
    reserved: int  # bytes the caching allocator holds
    total: int


class CellOom(TypedDict):
    """The state at a cell's out-of-memory failure."""

    message: str
    requested: int | None
    capacity: int | None
    live: dict[str, int]  # bytes per category alive then
    holders: list[tuple[str, int]]  # (variable, bytes)
    site: list[tuple[str, int, str]]  # (file, line, function) of the failing request
    phase: str


class LastCell(TypedDict):
    """The last measured cell: these fields of vram_magic.ranks.payload.report_to_dict(report, detail=False)."""

    cell: int | None
    device: str
    after: dict[str, int]  # bytes per category after the cell; they add up to its total
    peak: dict[str, int]  # bytes per category at the cell's peak
    wall_time: float  # seconds
    error: str | None  # what the cell raised
    oom: CellOom | None


class Figures(TypedDict):
    """A kernel's own figures: the file it writes while vram_magic is loaded."""

    format: int
    pid: int
    kernel_id: str | None
    notebook: str | None
    time: float  # when a figure last changed (seconds since the epoch)
    devices: list[OwnDevice]
    last_cell: LastCell | None
    measured_cells: int


class Gpu(TypedDict):
    """A kernel's memory on one GPU."""

    index: int | None  # NVML's device index
    device: str | None  # the kernel's own name for it ("cuda:0"), from its figures
    name: str | None
    used: int  # bytes: the process's GPU memory (NVML) or the kernel's reserved bytes (its own figures)
    total: int | None
    allocated: int | None  # bytes in tensors, from the kernel's own figures
    source: Literal["nvml", "vram_magic"]


class Kernel(TypedDict):
    """One kernel of the server."""

    id: str
    name: str | None
    execution_state: str | None
    last_activity: str | None  # ISO 8601
    session: str | None
    path: str | None
    type: str | None
    pid: int | None
    pid_source: Literal["kernel", "provisioner"] | None
    local_pid: int | None  # the pid in the server's pid namespace
    nspid: list[int] | None  # the pid in each nested namespace, outermost first
    rss: int | None  # resident bytes of the kernel and its child processes
    gpu: list[Gpu]
    vram_magic: Figures | None  # its own figures, where vram_magic is loaded
    history: list[tuple[float, int | None, int]]  # (time s, rss, gpu bytes)


class Device(TypedDict):
    """A GPU as NVML sees it, with the kernels' share and the other processes'."""

    index: int
    name: str
    uuid: str
    total: int
    used: int
    free: int
    mig: bool
    processes: int
    kernels: int
    other: int | None  # unknown where some process has no per-process figure


class Category(TypedDict):
    """A memory category in the reports' order and palette."""

    name: str
    label: str
    color: str


class Server(TypedDict):
    """The server that answered."""

    pid: int
    time: float


class KernelsReply(TypedDict):
    """What ``GET {base_url}vram-magic/kernels`` answers."""

    kernels: list[Kernel]
    devices: list[Device]
    notes: list[str]
    categories: list[Category]
    server: Server
    took_ms: float


@cache
def hints(kind: type) -> dict[str, Any]:
    """``{key: type}`` of a schema type, in order (read once: each figures file read is checked against them)."""
    return get_type_hints(kind)


def fields(kind: type) -> tuple[str, ...]:
    """The keys of a schema type, in order."""
    return tuple(hints(kind))


def problems(value: Any, kind: Any, where: str = "") -> list[str]:
    """What in ``value`` does not match the schema type ``kind``: ``[]`` when it matches (a missing or extra key, a
    value of another type), each problem with the path to it."""
    here = where or "the value"
    shape, args = _shape(kind)
    if shape == "object":
        if not isinstance(value, dict):
            return [f"{here}: {type(value).__name__}, not an object"]
        known = hints(kind)
        out = [f"{where}.{k}: missing" for k in known if k not in value]
        out += [f"{where}.{k}: not in the schema" for k in value if k not in known]
        for k, sub in args:
            if k in value:
                out += problems(value[k], sub, f"{where}.{k}")
        return out
    if shape == "optional":  # X | None
        return [] if value is None else problems(value, args, where)
    if shape == "union":
        found = [problems(value, a, where) for a in args]
        return [] if any(not p for p in found) else [f"{here}: {value!r:.60} is none of {_name(kind)}"]
    if shape == "literal":
        return [] if value in args else [f"{here}: {value!r:.60} is none of {args}"]
    if shape == "list":
        if not isinstance(value, list):
            return [f"{here}: {type(value).__name__}, not a list"]
        return [p for i, v in enumerate(value) for p in problems(v, args, f"{where}[{i}]")]
    if shape == "tuple":
        if not isinstance(value, list) or len(value) != len(args):
            return [f"{here}: not a list of {len(args)}"]
        return [p for i, (v, a) in enumerate(zip(value, args)) for p in problems(v, a, f"{where}[{i}]")]
    if shape == "dict":
        if not isinstance(value, dict):
            return [f"{here}: {type(value).__name__}, not an object"]
        return [p for k, v in value.items() for p in problems(v, args, f"{where}.{k}")]
    return [] if args(value) else [f"{here}: {value!r:.60} is not {_name(kind)}"]


_SCALARS = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool), type(None): lambda v: v is None}


@cache
def _shape(kind: Any) -> tuple[str, Any]:
    """What kind of check ``kind`` asks for, and what the check needs (worked out once per type)."""
    if is_typeddict(kind):
        return "object", tuple(hints(kind).items())
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        others = tuple(a for a in args if a is not type(None))
        if len(others) == 1 and len(args) == 2:
            return "optional", others[0]
        return "union", args
    if origin is Literal:
        return "literal", args
    if origin is list:
        return "list", args[0]
    if origin is tuple:
        return "tuple", args
    if origin is dict:
        return "dict", args[1]
    return "scalar", _SCALARS[kind]


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind)
