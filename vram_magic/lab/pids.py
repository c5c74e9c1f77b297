"""Each kernel's pid, from the kernel itself: ipykernel answers a ``usage_request`` on the control channel with
``os.getpid()`` (what jupyter-resource-usage asks). A kernel is asked once per start — its pid does not change
until it restarts — and the answer is cached; the local provisioner's pid stands in until it comes, and for
kernels that never answer. Kernels with no local process (remote provisioners) are asked for their memory at
most once per poll, in the background: each call uses the last answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KernelPid:
    ready: Any  # the kernel manager's ``ready`` future of the start this entry belongs to
    launched: int | None  # the local provisioner's pid (None: no local process)
    reported: int | None = None  # the kernel's own os.getpid()
    usage: dict[str, Any] | None = None  # the last usage_reply (remote kernels)
    usage_time: float = 0.0
    task: asyncio.Task | None = field(default=None, repr=False)
    answered: bool = False


async def usage_request(kernel_manager: Any, timeout: float) -> dict[str, Any]:
    """Send one ``usage_request`` on the kernel's control channel and return the reply's content."""
    from jupyter_client.session import Session

    # a Session of its own: the manager's would give this client's sockets the same zmq identity as every other
    # client of the kernel in this process (the server's own), and the kernel's replies to them get lost
    own = kernel_manager.session
    client = kernel_manager.client(session=Session(key=own.key, signature_scheme=own.signature_scheme,
                                                   username=own.username))
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    try:
        msg = client.session.msg("usage_request", {})
        client.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no usage_reply")
            reply = await client.control_channel.get_msg(timeout=left)
            if reply.get("parent_header", {}).get("msg_id") == msg["header"]["msg_id"]:
                return dict(reply.get("content", {}))
    finally:
        client.stop_channels()


class KernelPids:
    """The cache: one entry per kernel id, renewed when the kernel restarts (a new ``ready`` future)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.entries: dict[str, KernelPid] = {}
        self.asked = 0  # usage_requests sent, for tests and benchmarks

    def _ask(self, kernel_id: str, km: Any, entry: KernelPid) -> None:
        self.asked += 1

        async def ask() -> None:
            try:
                content = await usage_request(km, self.timeout)
            except Exception:
                content = {}
            pid = content.get("pid")
            if isinstance(pid, int):
                entry.reported = pid
            if content:
                entry.usage, entry.usage_time = content, time.time()
            entry.answered = True

        entry.task = asyncio.ensure_future(ask())

    async def update(self, kernel_manager: Any, kernel_ids: list[str], wait: float = 0.0) -> dict[str, KernelPid]:
        """Entries for ``kernel_ids``; waits up to ``wait`` s for kernels asked for the first time. By default it
        does not wait: making a client costs milliseconds of the server's time per kernel, so the asks run after
        this answer (which gives the provisioners' pids) and the next poll has the kernels' own."""
        fresh = []
        for kid in kernel_ids:
            try:
                km = kernel_manager.get_kernel(kid)
            except KeyError:
                continue
            launched = getattr(getattr(km, "provisioner", None), "pid", None)
            launched = launched if isinstance(launched, int) else None
            ready = getattr(km, "ready", None)
            entry = self.entries.get(kid)
            if entry is None or entry.ready is not ready or entry.launched != launched:
                entry = self.entries[kid] = KernelPid(ready=ready, launched=launched)
                self._ask(kid, km, entry)
                fresh.append(entry.task)
            elif launched is None and (entry.task is None or entry.task.done()):
                self._ask(kid, km, entry)  # a remote kernel: its memory, once per poll
        if fresh and wait > 0:
            await asyncio.wait(fresh, timeout=wait)
        for gone in set(self.entries) - set(kernel_ids):
            task = self.entries.pop(gone).task
            if task is not None and not task.done():
                task.cancel()
        return {kid: self.entries[kid] for kid in kernel_ids if kid in self.entries}

    def close(self) -> None:
        for entry in self.entries.values():
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()
        self.entries.clear()
