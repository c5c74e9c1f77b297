"""The six memory categories and :class:`Breakdown`, bytes per category: the leaf every result, trace and
renderer builds on."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "other")
LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "kv_cache": "KV cache",
    "other": "other",
}
#: categories that tables, legends and columns show only where some breakdown in view has them
OPTIONAL: frozenset[str] = frozenset({"kv_cache"})
#: the model states: what a mixture of experts splits into its routed experts' share and the dense rest
MODEL_STATES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state")
#: the mark on a detail label of the routed experts of mixture-of-experts blocks (engine/scan/experts.py)
EXPERTS = " (experts)"


def shown_categories(*breakdowns: Mapping[str, int] | None) -> tuple[str, ...]:
    """The categories a view of these breakdowns shows: all of them, less an optional one (the KV cache) that
    every breakdown has at zero, so views of training cells keep their five columns."""
    present = [b for b in breakdowns if b is not None]
    return tuple(c for c in CATEGORIES if c not in OPTIONAL or any(b.get(c, 0) for b in present))


@dataclass(frozen=True)
class Breakdown(Mapping[str, int]):
    """Bytes per category; the six categories (``kv_cache`` zero where nothing generates) add up to :attr:`total`.

    ``detail`` refines them: ``(category, label, bytes)`` rows such as ``("other", "x", 4096)`` for a tensor
    held by the variable ``x`` or ``("activations", "graph held by loss", ...)``.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    kv_cache: int = 0
    other: int = 0
    detail: tuple[tuple[str, str, int], ...] = ()

    def __getitem__(self, key: str) -> int:
        if key not in CATEGORIES:
            raise KeyError(key)
        return int(getattr(self, key))

    def __iter__(self) -> Iterator[str]:
        return iter(CATEGORIES)

    def __len__(self) -> int:
        return len(CATEGORIES)

    @property
    def total(self) -> int:
        return sum(self[c] for c in CATEGORIES)

    @property
    def trainable(self) -> int:
        """Bytes of parameters that train: all of them less the rows named frozen (``requires_grad=False``, and
        quantized weights, which never train)."""
        return self.parameters - sum(n for c, label, n in self.detail if c == "parameters" and "(frozen" in label)

    @property
    def experts(self) -> dict[str, int]:
        """Bytes of the routed experts of mixture-of-experts blocks (the detail rows marked :data:`EXPERTS`) in each of
        parameters, gradients and optimizer state: ``{"parameters": …, "gradients": …, "optimizer_state": …}``,
        zeros for a dense model. The rest of each category is the dense part (attention, embeddings, shared experts,
        routers)."""
        out = dict.fromkeys(MODEL_STATES, 0)
        for cat, label, n in self.detail:
            if cat in out and EXPERTS in label:
                out[cat] += n
        return out

    def details(self, category: str | None = None) -> dict[str, int]:
        """``{label: bytes}`` of the detail rows, optionally of one category only."""
        out: dict[str, int] = {}
        for cat, label, n in self.detail:
            if category is None or cat == category:
                out[label] = out.get(label, 0) + n
        return out

    def __sub__(self, other: Breakdown) -> Breakdown:
        rows: dict[tuple[str, str], int] = {}
        for cat, label, n in self.detail:
            rows[(cat, label)] = rows.get((cat, label), 0) + n
        for cat, label, n in other.detail:
            rows[(cat, label)] = rows.get((cat, label), 0) - n
        return Breakdown(
            **{c: self[c] - other[c] for c in CATEGORIES},
            detail=tuple((c, lab, n) for (c, lab), n in rows.items() if n),
        )

    @classmethod
    def from_rows(cls, rows: Mapping[tuple[str, str], int]) -> Breakdown:
        """Build from ``{(category, label): bytes}``."""
        sums = dict.fromkeys(CATEGORIES, 0)
        for (cat, _), n in rows.items():
            sums[cat] += n
        detail = tuple(sorted([(c, lab, n) for (c, lab), n in rows.items() if n], key=itemgetter(2), reverse=True))
        return cls(**sums, detail=detail)

    def as_dict(self) -> dict[str, int]:
        return {c: self[c] for c in CATEGORIES}
def breakdown_to_dict(b: Breakdown, detail: bool = True) -> dict[str, Any]:
    """A breakdown as JSON-ready plain data (what crosses a process boundary, or a file)."""
    out: dict[str, Any] = {c: int(b[c]) for c in CATEGORIES}
    if detail:
        out["detail"] = [[c, label, int(n)] for c, label, n in b.detail]
    return out


def breakdown_from_dict(d: Mapping[str, Any]) -> Breakdown:
    return Breakdown(**{c: int(d.get(c, 0)) for c in CATEGORIES},
                     detail=tuple((str(c), str(label), int(n)) for c, label, n in d.get("detail", ())))


