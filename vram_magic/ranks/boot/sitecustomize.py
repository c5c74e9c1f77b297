"""Loaded at startup by every Python process whose ``PYTHONPATH`` names this folder, which ``%%vram --ranks``
(and ``python -m vram_magic ranks run``) does for the processes a cell starts: spawned ranks and ``torchrun``'s
workers then measure themselves (see :mod:`vram_magic.ranks.child`). Any other ``sitecustomize`` on the path
is loaded too, as if this one were not there. Nothing here may fail the process."""


def _load_the_next_one() -> None:
    import importlib
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        del sys.modules["sitecustomize"]
        importlib.import_module("sitecustomize")
    except Exception:
        pass
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _arm() -> None:
    import os
    import sys

    if not os.environ.get("VRAM_MAGIC_RANKS"):
        return
    try:
        from vram_magic.ranks.child import boot
    except ImportError:  # vram_magic is not installed where this interpreter looks: from the folder it lives in
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
        try:
            from vram_magic.ranks.child import boot
        except ImportError:
            return
    boot()


try:
    _load_the_next_one()
    _arm()
except Exception:
    pass
