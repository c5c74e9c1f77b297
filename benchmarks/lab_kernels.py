"""Cost of JupyterLab's ``GET vram-magic/kernels`` with N real kernels, and of the figures file a kernel writes.

    python benchmarks/lab_kernels.py [--kernels 10] [--loaded 5] [--calls 30]

Starts a Jupyter server in this process with the extension, opens N notebooks' kernels through the sessions
API (``--loaded`` of them import torch, hold a tensor and run ``%load_ext vram_magic`` and one measured cell),
then times the route: the first call (every kernel asked for its pid, concurrently) and ``--calls`` more
(end to end over HTTP, and the collector alone), and counts the usage_requests sent (one per kernel per start is
the target; each later poll asks none). Then, in an IPython shell, the figures file's write per cell: an empty
cell with and without the writer, side by side. Target: one call <= 100 ms for 10 kernels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time


def _ms(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return f"median {statistics.median(values):7.2f} ms   p90 {p90:7.2f} ms   max {max(values):7.2f} ms"


async def _execute(km, code: str, timeout: float = 180) -> None:
    from jupyter_client.session import Session

    client = km.client(session=Session(key=km.session.key))
    client.start_channels(iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = client.execute(code, allow_stdin=False)
        while True:
            msg = await client.get_shell_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["content"]["status"] != "ok":
                    raise RuntimeError(f"{code!r}: {msg['content'].get('evalue')}")
                return
    finally:
        client.stop_channels()


async def route(app, args) -> None:
    import urllib.request

    collector = app.web_app.settings["vram_magic_collector"]
    t0 = time.perf_counter()
    models = await asyncio.gather(*[app.session_manager.create_session(
        path=f"nb{i:02d}.ipynb", name=f"nb{i:02d}.ipynb", type="notebook", kernel_name="python3")
        for i in range(args.kernels)])
    kms = [app.kernel_manager.get_kernel(m["kernel"]["id"]) for m in models]
    await asyncio.gather(*[km.ready for km in kms])
    for km in kms[:args.loaded]:
        await _execute(km, "import torch\nheld = torch.ones(16 * 2**20)\n%load_ext vram_magic")
        await _execute(km, "%%vram -q\nlayer = torch.nn.Linear(512, 512)")
    print(f"{args.kernels} kernels started ({args.loaded} with vram_magic loaded and a measured cell) in "
          f"{time.perf_counter() - t0:.1f} s")

    url = f"http://127.0.0.1:{app.port}{app.base_url}vram-magic/kernels"
    request = urllib.request.Request(url, headers={"Authorization": f"token {app.identity_provider.token}"})
    loop = asyncio.get_running_loop()

    async def get() -> tuple[float, dict]:
        # from another thread, as a browser would: the server's loop only serves
        def fetch() -> tuple[float, bytes]:
            t = time.perf_counter()
            with urllib.request.urlopen(request) as r:
                body = r.read()
            return (time.perf_counter() - t) * 1000, body

        ms, body = await loop.run_in_executor(None, fetch)
        return ms, body

    first, body = await get()
    first_inner = json.loads(body)["took_ms"]
    first_sources = sorted({k["pid_source"] for k in json.loads(body)["kernels"]})
    asked_first = collector.pids.asked
    await asyncio.sleep(1.0)  # answers still on their way land in the cache
    ends, inner = [], []
    for _ in range(args.calls):
        ms, body = await get()
        ends.append(ms)
        inner.append(json.loads(body)["took_ms"])
    data = json.loads(body)
    asked = collector.pids.asked
    own = sum(1 for k in data["kernels"] if k["vram_magic"])
    by_kernel = sum(1 for k in data["kernels"] if k["pid_source"] == "kernel")
    print(f"first call (asks every kernel for its pid): {first:7.2f} ms end to end, {first_inner:.2f} ms in the "
          f"collector, {asked_first} usage_requests, pids from {', '.join(first_sources)}")
    print(f"{args.calls} calls over HTTP:  {_ms(ends)}")
    print(f"the collector alone:     {_ms(inner)}")
    print(f"usage_requests after {args.calls + 1} calls: {asked} (one per kernel start: {args.kernels}); "
          f"pids from the kernels {by_kernel}/{len(data['kernels'])}, own figures {own}/{args.loaded}, "
          f"bytes per answer {len(body)}")
    target = "met" if statistics.median(ends) <= 100 else "NOT met"
    print(f"target <= 100 ms per call for {args.kernels} kernels: {target}")
    for m in models:
        await app.session_manager.delete_session(m["id"])


def serve(args) -> None:
    from jupyter_server.serverapp import ServerApp

    root = tempfile.mkdtemp(prefix="vram-lab-bench-")
    app = ServerApp.instance(open_browser=False, root_dir=root, port=0, log_level="WARN", allow_root=True,
                             jpserver_extensions={"vram_magic.lab": True})
    app.initialize(argv=[])

    async def main() -> None:
        try:
            await route(app, args)
        finally:
            app.io_loop.add_callback(app.stop)

    app.io_loop.add_callback(main)
    app.start()


def writer(cells: int) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    from vram_magic.lab.figures import start_figures

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext vram_magic")
    sh.run_cell("import torch\nlin = torch.nn.Linear(256, 256)")
    sh.run_cell("%%vram -q\nx = lin(torch.ones(64, 256))")

    def per_cell() -> float:
        t = time.perf_counter()
        for _ in range(cells):
            sh.run_cell("pass")
        return (time.perf_counter() - t) / cells * 1e6

    rows = []
    for _ in range(3):  # alternate, so load changes hit both alike
        rows.append(("without", per_cell()))
        w = start_figures(sh, sh._vram_magic_extension.session, folder=tempfile.mkdtemp())
        rows.append(("with", per_cell()))
        size = os.path.getsize(w.path)
        w.stop()
    without = statistics.median(v for k, v in rows if k == "without")
    with_ = statistics.median(v for k, v in rows if k == "with")
    print(f"an empty cell: {without:7.1f} µs without the figures writer, {with_:7.1f} µs with it "
          f"(+{with_ - without:.1f} µs, a {size} B file); median of 3 × {cells} cells each")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", type=int, default=10)
    p.add_argument("--loaded", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--cells", type=int, default=300)
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    serve(args)
    writer(args.cells)


if __name__ == "__main__":
    main()
