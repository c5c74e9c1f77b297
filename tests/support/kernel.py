"""A real Jupyter kernel (ipykernel, the Python running the tests) driven over jupyter_client, as a frontend drives
it: every iopub message of a request kept in order with the kernel's own timestamps."""

from __future__ import annotations

import json
import os
import queue
import time
from collections.abc import Callable
from typing import Any

import jupyter_client


class Kernel:
    def __init__(self, forward_fds: bool = False) -> None:
        """``forward_fds``: the kernel forwards what is written to descriptors 1 and 2 as a user's kernel does
        (ipykernel turns that off when it finds pytest's variable in its environment)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if forward_fds:
            env.pop("PYTEST_CURRENT_TEST", None)
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 120,
            interrupt_when: Callable[[list[dict[str, Any]]], bool] | None = None) -> dict[str, Any]:
        """Run ``code``; returns the iopub messages of that request (in order) and the reply. ``interrupt_when``:
        interrupt the kernel once it says yes to the messages received so far."""
        msg_id = self.kc.execute(code)
        messages: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        interrupted = False
        while True:
            if interrupt_when is not None and not interrupted and interrupt_when(messages):
                self.km.interrupt_kernel()
                interrupted = True
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no idle after {timeout} s running {code[:60]!r}") from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                messages.append(msg)  # e.g. a watch redrawn from its thread while this cell runs
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=10)
        while reply["parent_header"].get("msg_id") != msg_id:  # e.g. a late reply to wait_for_ready's kernel_info
            reply = self.kc.get_shell_msg(timeout=10)
        return {"messages": messages, "reply": reply["content"], "msg_id": msg_id}

    def value(self, expr: str) -> Any:
        out = self.run(f"import json as _j; print(_j.dumps({expr}))")
        text = "".join(m["content"]["text"] for m in out["messages"] if m["msg_type"] == "stream")
        return json.loads(text.strip().splitlines()[-1])

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
