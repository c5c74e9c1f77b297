"""A real Jupyter server with the vram_magic extension, for the route's tests (``from lab_server import *``).

pytest-jupyter's fixtures are imported into the test modules that use them (``pytest_jupyter`` is not loaded
as a plugin for the whole suite: its autouse event-loop fixtures would reach every other test). Tests are
synchronous and drive the server's event loop with :func:`run`.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pytest_jupyter.jupyter_core import *  # noqa: F403
from pytest_jupyter.jupyter_server import *  # noqa: F403
from pytest_jupyter.pytest_tornasync import *  # noqa: F403

MiB = 2**20


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"vram_magic.lab": True}}}


@pytest.fixture
def lab(jp_serverapp, jp_fetch, jp_asyncio_loop):
    """Helpers bound to one server: ``lab.get()`` is the route's JSON, ``lab.open(path)`` starts a notebook's
    kernel through the sessions API, ``lab.execute(kernel_id, code)`` runs code in it."""
    return Lab(jp_serverapp, jp_fetch, jp_asyncio_loop)


class Lab:
    def __init__(self, app, fetch, loop):
        self.app, self.fetch, self.loop = app, fetch, loop
        self.clients = {}

    def run(self, coro, timeout=120):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def get(self):
        r = self.run(self.fetch("vram-magic", "kernels", method="GET"))
        assert r.code == 200
        return json.loads(r.body)

    def open(self, path):
        """A session for notebook ``path`` with a python3 kernel; returns (session id, kernel id)."""
        body = json.dumps({"path": path, "type": "notebook", "name": path, "kernel": {"name": "python3"}})
        r = self.run(self.fetch("api", "sessions", method="POST", body=body))
        model = json.loads(r.body)
        return model["id"], model["kernel"]["id"]

    def close(self, session_id):
        self.run(self.fetch("api", "sessions", session_id, method="DELETE"))

    def execute(self, kernel_id, code, timeout=120):
        """Run ``code`` in the kernel (as a user's cell); returns its text/plain result or stdout."""
        client = self.clients.get(kernel_id)
        if client is None:
            km = self.app.kernel_manager.get_kernel(kernel_id)
            client = self.clients[kernel_id] = km.client()
            client.start_channels()
            self.run(client.wait_for_ready(timeout=timeout), timeout)
        out = []

        def hook(msg):
            c = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(c["text"])
            elif msg["msg_type"] in ("execute_result", "display_data"):
                out.append(c["data"].get("text/plain", ""))
            elif msg["msg_type"] == "error":
                out.append("\n".join(c["traceback"]))

        reply = self.run(client.execute_interactive(code, output_hook=hook, timeout=timeout), timeout + 5)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", text
        return text

    def wait(self, predicate, timeout=30):
        """The route's JSON once ``predicate(data)`` holds (polled every 0.2 s)."""
        deadline = time.monotonic() + timeout
        while True:
            data = self.get()
            if predicate(data) or time.monotonic() > deadline:
                return data
            self.run(asyncio.sleep(0.2))

    def stop_clients(self):
        for c in self.clients.values():
            c.stop_channels()
        self.clients.clear()


def kernel(data, kernel_id):
    return next((k for k in data["kernels"] if k["id"] == kernel_id), None)
