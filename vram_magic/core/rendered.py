"""How a result shows itself: :class:`Rendered`, the one place that turns a result's two renderers into
``print()``, IPython's pretty printer and a notebook's rich display."""

from __future__ import annotations

from typing import Any


class Rendered:
    """Mixin for a result that renders itself. A subclass writes ``_text()`` and ``_html()``, each importing its
    renderer inside the method (the result's module stays free of the render layer until it is shown); this class
    gives it ``__str__``, ``_repr_pretty_`` and ``_repr_mimebundle_`` with the same text everywhere.

    A frozen dataclass takes it as a base (``@dataclass(frozen=True) class X(Rendered)``): it adds no field and no
    ``__init__``, and leaves the dataclass's ``__repr__`` as it is."""

    __slots__ = ()

    def _text(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no text renderer")

    def _html(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no HTML renderer")

    def __str__(self) -> str:
        return self._text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self._text())

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self._text(), "text/html": self._html()}
