"""Command line: ``python -m vram_magic demo``, ``python -m vram_magic estimate MODULE:BUILDER …``,
``python -m vram_magic plan MODULE:BUILDER …``, ``python -m vram_magic ranks …`` (a distributed job's memory per
rank) and ``python -m vram_magic run script.py`` (a script run with the out-of-memory black box)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m vram_magic demo
       python -m vram_magic estimate package.module:build_model [options]   (see: estimate --help)
       python -m vram_magic plan package.module:build_model --gpu L4 [options]   (see: plan --help)
       python -m vram_magic ranks run [-o DIR] -- torchrun … script.py      (each rank's memory)
       python -m vram_magic ranks DIR                                       (see: ranks --help)
       python -m vram_magic run [--out DIR] script.py [args]               (out-of-memory errors explained)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .measuring.demo import run_demo

        run_demo()
        return 0
    if cmd == "estimate":
        from .estimator.cli.estimate_cmd import main as estimate_main

        return estimate_main(rest)
    if cmd == "plan":
        from .estimator.cli.plan_cmd import main as plan_main

        return plan_main(rest)
    if cmd == "run":
        from .oom.script import main as run_main

        return run_main(rest)
    if cmd == "ranks":
        from .ranks.cli import main as ranks_main

        return ranks_main(rest)
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
