"""Ranks forked from a process that has run backward: whether they can run backward themselves, and what to say.

PyTorch's autograd engine starts one worker thread per accelerator device at a process's first backward pass, if
it sees any device then: a GPU, and on recent CUDA builds also the stand-in CUDA device that fake tensors install
when there is no GPU (``FakeTensorMode``, which ``%vram_estimate`` steps on). Starting those threads registers a
``pthread_atfork`` handler that marks every process forked afterwards, and autograd refuses to run in a marked
process: "Unable to handle autograd's threading in combination with fork-based multiprocessing"
(``torch/csrc/autograd/engine.cpp``). Nothing undoes it in the parent. Ranks started by fork —
``accelerate.notebook_launcher``, ``torch.multiprocessing`` with ``start_method="fork"`` — then fail at their
first backward; ranks started by spawn or ``torchrun`` are new interpreters and are not affected.

:func:`forked_backward_refused` tells it before a ``%%vram --ranks`` cell runs, by forking a child that runs one
backward on a one-element tensor. When it is so, :func:`notice_at_fork` has the first fork of the cell say what to
do, on stderr, before the ranks start; and the per-rank view repeats it (:func:`refused_in`) when they failed so.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

#: the start of PyTorch's message in a forked process where autograd refuses to run
PYTORCH_MESSAGE = "Unable to handle autograd's threading in combination with fork-based multiprocessing"

_REFUSED, _ALLOWED, _UNKNOWN = 3, 0, 2  # the probe's exit codes
_refused_for_good = False  # once PyTorch has registered its handler, it stays: no need to ask again
_notice: str | None = None  # what the next fork says (while a cell runs, in a process where forks are refused)
_hook_registered = False
_QUIET_FORKS = ("pty", "ptyprocess", "pexpect", "subprocess")  # forks whose child runs a program at once


def advice(estimate: str | None = None, output: str | None = None) -> str:
    """What to do about it, naming the cell's ``--estimate`` and ``-o`` variables when it has them."""
    est = estimate or "est"
    out = output or "per_rank"
    made = f"; --estimate {estimate} was made before this cell" if estimate else ""
    return ("ranks forked from this kernel cannot run backward: it has run a backward pass already (a training "
            f"step, or %vram_estimate's step on fake tensors{made}), and PyTorch then refuses autograd in processes "
            "forked from it (CUDA builds; recent ones also without a GPU). Restart the kernel and run this cell "
            f"first, with -o {out}; then make the estimate and attach it: {out}.with_estimate({est}). Or start the "
            "ranks by spawn (start_method=\"spawn\", the function in a file) or with torchrun on a ! line")


def forked_backward_refused(timeout: float = 5.0) -> bool | None:
    """Whether a process forked from this one now would be refused a backward pass (``None``: it cannot be told —
    no ``os.fork``, or the probe did not answer within ``timeout`` seconds)."""
    global _refused_for_good
    if _refused_for_good:
        return True
    if "torch" not in sys.modules:  # no backward has run here
        return False
    if not hasattr(os, "fork"):
        return None
    code = _probe(timeout)
    if code == _REFUSED:
        _refused_for_good = True
        return True
    return False if code == _ALLOWED else None


def _probe(timeout: float) -> int | None:
    import torch

    with warnings.catch_warnings():  # Python 3.12+ warns about forking a process with threads: the child only
        warnings.simplefilter("ignore", DeprecationWarning)  # runs the lines below, then leaves
        pid = os.fork()
    if pid == 0:
        code = _UNKNOWN
        try:
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.ones(1, requires_grad=True)
                (x * 2).sum().backward()
            code = _ALLOWED
        except RuntimeError as err:
            code = _REFUSED if PYTORCH_MESSAGE in str(err) else _UNKNOWN
        except BaseException:
            code = _UNKNOWN
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _end(pid)
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _end(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def notice_at_fork(text: str | None) -> None:
    """While ``text`` is set, the next fork of this process (not one that runs a program: ``!`` lines,
    ``subprocess``) writes it on stderr first; ``None`` stops that."""
    global _notice, _hook_registered
    _notice = text
    if text is not None and not _hook_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork)
        _hook_registered = True


def _before_fork() -> None:
    global _notice
    text = _notice
    if text is None or _forking_to_run_a_program():
        return
    _notice = None  # once per cell
    try:
        print(f"vram_magic: {text}.", file=sys.stderr, flush=True)
    except Exception:
        pass


def _forking_to_run_a_program() -> bool:
    """Whether the code that forks is a terminal or subprocess module, whose child runs a program at once."""
    f: Any = sys._getframe(2)  # 0: here, 1: the fork hook, 2: the code that called os.fork
    for _ in range(4):
        if f is None:
            break
        name = str(f.f_globals.get("__name__", ""))
        if name.split(".")[0] in _QUIET_FORKS:
            return True
        f = f.f_back
    return False


def refused_in(texts: Any) -> bool:
    """Whether any of ``texts`` (the ranks' errors, what the launcher raised) is PyTorch's refusal."""
    return any(PYTORCH_MESSAGE in str(t) for t in texts if t)
