"""``%vram …``: the session's memory now, its history, diff, auto mode, budget, save, export, reset, watch."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from .checks import Host, check_path, size

LINE_HELP = (
    "%vram                 memory of the device now\n"
    "%vram all             memory of the CPU and of every visible GPU now (never initialises CUDA)\n"
    "%vram --device DEV    memory of one device now (cpu, cuda, cuda:N)\n"
    "%vram history         one row per measured cell (pandas DataFrame)\n"
    "%vram diff [A B]      compare two measured cells (default: the last two)\n"
    "%vram auto on|off     measure every cell\n"
    "%vram oom on|off      explain every out-of-memory error under its traceback (on by default)\n"
    "%vram budget SIZE|off simulate a device of SIZE (e.g. 4GiB) for the following cells\n"
    "%vram save PATH [N]   write cell N's (default: last) allocation history as a PyTorch snapshot pickle\n"
    "%vram export PATH     write the history as .csv or .json\n"
    "%vram reset           forget the history\n"
    "%vram watch [DEV] [--interval S]  a standing monitor of the device's memory, updated while cells run\n"
    "%vram watch off       stop it"
)


def devices() -> list[str]:
    """The CPU and every visible GPU (never initialises CUDA: NVML counts them)."""
    from ..engine.cuda.device import device_count

    return ["cpu"] + [f"cuda:{i}" for i in range(device_count())]


def line_command(host: Host, line: str) -> Any:
    """Run ``%vram LINE``; its value (memory now, a DataFrame) or None once it has printed what it did."""
    session = host.session
    words = line.split()
    if not words:
        return session.now()
    cmd, rest = words[0], words[1:]
    try:
        if cmd == "all":  # every device: the CPU and each visible GPU
            return [session.now(dev) for dev in devices()]
        if cmd == "history":
            return session.history_frame()
        if cmd == "diff":
            if len(rest) not in (0, 2):
                raise UsageError("usage: %vram diff [A B] (two measured cell numbers)")
            return session.diff(*rest) if rest else session.diff()
        if cmd == "auto":
            if rest not in (["on"], ["off"]):
                raise UsageError("usage: %vram auto on|off")
            host.set_auto(rest[0] == "on")
            print(f"%vram auto {rest[0]}: {'every cell is measured' if session.auto else 'cells are not measured'}")
            return None
        if cmd == "oom":
            if rest not in (["on"], ["off"]):
                raise UsageError("usage: %vram oom on|off")
            host.oom = rest[0] == "on"
            print(f"%vram oom {rest[0]}: out-of-memory errors are {'explained' if host.oom else 'not explained'}")
            return None
        if cmd == "watch":
            from .watch import watch_command

            message = watch_command(host, rest)
            if message:
                print(message)
            return None
        if cmd == "reset":
            session.reset()
            print("%vram: history cleared")
            return None
        if cmd == "budget":
            if len(rest) != 1:
                raise UsageError("usage: %vram budget SIZE|off (e.g. %vram budget 4GiB)")
            session.budget = None if rest[0] == "off" else size(rest[0])
            return None
        if cmd in ("save", "export"):
            return _write(host, cmd, rest)
        if cmd.startswith("-") or cmd in ("cpu",) or cmd.startswith("cuda"):
            dev = rest[0] if cmd == "--device" and rest else (cmd if not cmd.startswith("-") else None)
            if dev is None:
                raise UsageError("usage: %vram [--device DEV]")
            return session.now(dev)
    except ValueError as err:
        raise UsageError(str(err)) from None
    raise UsageError(f"unknown %vram subcommand {cmd!r}. Use:\n{LINE_HELP}")


def _write(host: Host, cmd: str, rest: list[str]) -> None:
    """``%vram save PATH [CELL]`` (a PyTorch memory snapshot) and ``%vram export PATH`` (the history)."""
    session = host.session
    if cmd == "save":
        if len(rest) not in (1, 2):
            raise UsageError("usage: %vram save PATH [CELL]")
        report = session.report(rest[1] if len(rest) == 2 else -1)
        check_path(rest[0])
        try:
            path = report.save_snapshot(rest[0])
        except OSError as err:
            raise UsageError(f"cannot write {rest[0]!r}: {err.strerror or err}") from None
        print(f"%vram: wrote {path} (open it at PyTorch's memory viewer)")
        return None
    if len(rest) != 1:
        raise UsageError("usage: %vram export PATH.csv|PATH.json")
    from ..session.tables import export_history

    check_path(rest[0])
    try:
        written = export_history(list(session.history), rest[0])
    except OSError as err:
        raise UsageError(f"cannot write {rest[0]!r}: {err.strerror or err}") from None
    print(f"%vram: wrote {written}")
    return None
