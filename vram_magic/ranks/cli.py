"""``python -m vram_magic ranks``: the per-rank view in a terminal.

    python -m vram_magic ranks run [-o DIR] -- torchrun --nproc-per-node 2 train.py
    python -m vram_magic ranks DIR [--world N] [--json]

``run`` starts the command with its ranks armed (as ``%%vram --ranks`` does in a notebook), waits for it and
prints every rank's memory; ``-o DIR`` keeps the per-rank reports there. ``DIR`` renders reports kept so, or
written by ``RankReports.save(DIR)`` in a script.
"""

from __future__ import annotations

import argparse
import json
import sys

USAGE = """usage: python -m vram_magic ranks DIR [--world N] [--json]
       python -m vram_magic ranks run [-o DIR] -- COMMAND …   (e.g. torchrun --nproc-per-node 2 train.py)"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "run":
        return _run(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m vram_magic ranks", description="print a job's per-rank memory")
    parser.add_argument("dir", help="the folder of per-rank reports (rank-NNNNN.json)")
    parser.add_argument("--world", type=int, help="the job's number of ranks (those without a report are listed)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON instead")
    args = parser.parse_args(argv)
    from .result import RankReports

    try:
        reports = RankReports.load(args.dir, world=args.world, title=f"ranks of {args.dir}")
    except FileNotFoundError as err:
        print(f"vram_magic ranks: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        print(reports)
    return 0 if len(reports) else 1


def _run(argv: list[str]) -> int:
    directory = None
    if argv[:1] in (["-o"], ["--output"]):
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        directory, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    from .launch import run

    try:
        code, reports = run(argv, directory, title=" ".join(argv[:3]) + (" …" if len(argv) > 3 else ""))
    except FileNotFoundError as err:
        print(f"vram_magic ranks run: cannot start {argv[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 127
    print(reports)
    if directory:
        print(f"per-rank reports kept in {directory} (python -m vram_magic ranks {directory})")
    return code
