"""Byte sizes: parsing what users type and printing in binary units (as nvidia-smi and PyTorch do); counts as
people say them."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


#: sizes beyond this are not memory any device has (1 EiB): rejected as typos rather than accepted as "no limit"
MAX_SIZE = 2**60


def parse_size(text: str | int) -> int:
    """Return the number of bytes in ``text`` (``"48MiB"``, ``"4 GiB"``, ``"1.5GB"``, ``"4096"``).

    ``KiB/MiB/GiB/TiB`` (and the bare letters ``K/M/G/T``) are powers of 1024; ``KB/MB/GB/TB`` are powers
    of 1000, as printed on GPU boxes. A size must be at least one byte and at most 1 EiB.
    """
    if isinstance(text, bool):
        raise TypeError("a size must be a string like '4GiB' or a number of bytes, not a bool")
    if isinstance(text, int):
        if text < 1:
            raise ValueError(f"a size must be at least 1 byte, not {text}")
        if text > MAX_SIZE:
            raise ValueError(f"{text} bytes is more than any device has (at most 1 EiB); check the number")
        return text
    if not isinstance(text, str):
        raise TypeError(f"a size must be a string like '4GiB' or a number of bytes, not {type(text).__name__}")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with a unit, e.g. '512MiB', '4GiB', '1.5GB' "
            "(KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000)"
        )
    try:
        value = float(match.group(1)) * _UNITS[unit]
    except OverflowError:
        value = float("inf")
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ValueError(f"{text!r} is more than any device has (at most 1 EiB); check the number")
    n = int(round(value))
    if n < 1:
        raise ValueError(f"{text!r} is less than one byte; write a size such as '512MiB' or '4GiB'")
    return n


def format_bytes(n: int | float, *, signed: bool = False) -> str:
    """``format_bytes(1536) == '1.50 KiB'``; with ``signed=True`` a ``+`` or ``−`` sign leads."""
    sign = "−" if n < 0 else ""
    if signed:
        sign = "+" if n > 0 else ("−" if n < 0 else "±")
    value = abs(float(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_BINARY) - 1:
        value /= 1024
        unit += 1
    digits = 2 if value < 10 else (1 if value < 100 else 0)
    return f"{sign}{value:.{digits}f} {_BINARY[unit]}"


def format_count(n: int) -> str:
    """``1_234`` → ``1.2 K``, ``6_738_415_616`` → ``6.74 B``: counts (of parameters) as people say them."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.{2 if value < 10 else 1}f} {unit}"
    return str(n)
