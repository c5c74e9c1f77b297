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

    def execute(self, kernel_id, code, expression=None, timeout=120):
        """Run ``code`` in the kernel (as a user's cell); returns ``expression`` evaluated after it (text/plain),
        read from the shell channel's reply (IOPub is not listened to: no output can be missed)."""
        client = self.clients.get(kernel_id)
        if client is None:
            from jupyter_client.session import Session

            km = self.app.kernel_manager.get_kernel(kernel_id)
            # its own Session (so its own zmq identity), as a second front end would have
            client = self.clients[kernel_id] = km.client(session=Session(key=km.session.key))
            client.start_channels(iopub=False, stdin=False, hb=False, control=False)
        expressions = {"r": expression} if expression else {}
        msg_id = client.execute(code, user_expressions=expressions, allow_stdin=False)

        async def reply():
            while True:
                msg = await client.get_shell_msg(timeout=timeout)
                if msg["parent_header"].get("msg_id") == msg_id:
                    return msg["content"]

        content = self.run(reply(), timeout + 5)
        assert content["status"] == "ok", f"{content.get('ename')}: {content.get('evalue')}"
        if expression:
            r = content["user_expressions"]["r"]
            assert r["status"] == "ok", f"{r.get('ename')}: {r.get('evalue')}"
            return r["data"]["text/plain"]
        return None

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
