"""``%vram watch [DEV] [--interval S]`` and ``%vram watch off``: the standing monitor (``vram_magic.session.monitor``),
kept in the session between cells."""

from __future__ import annotations

from ..session.monitor import parse_watch, start_watch, watch_device
from ..session.state import Session
from .checks import Host
from .display import has_frontend


def watch_command(host: Host, words: list[str]) -> str | None:
    """Start (or restart) the monitor, or stop it with ``off``. Returns a message, or raises ``ValueError``
    with the usage."""
    session: Session = host.session
    current = session.watch
    if words == ["off"]:
        if current is None or not current.running:
            session.watch = None
            return "%vram watch: no monitor is running"
        session.stop_watch()
        return None
    device, interval = parse_watch(words, float(getattr(host, "live_interval", 0.25)) * 2)
    if not has_frontend(host.shell):
        raise ValueError("%vram watch needs a notebook (a kernel with a frontend to update); in a terminal use %vram")
    dev = watch_device(device)
    session.stop_watch()
    session.watch = start_watch(dev, interval, session.registry)
    return None
