"""``tyingspec mutants``: the default kill matrix (each mutant up to its first kill, the rows in
one process per core) beside the previous behaviour (``--full --jobs 1``: every property against
every mutant, the rows one after another in one process), issue 53's "within 5 minutes wall on
an idle two-core machine".

Run from the repository root::

    python -m benchmarks.bench_mutants                      # every kind: the whole matrix
    python -m benchmarks.bench_mutants --kind model --kind kernel
    python -m benchmarks.bench_mutants --no-previous        # the default matrix alone

Each variant is a fresh ``python -m tyingspec mutants --kind K --quiet``-less command (its
progress lines go to a pipe), run once per kind named (``--kind all`` for one run of the whole
matrix; per-kind pieces when the previous behaviour is too long to run at once), interleaved
round by round.  Prints each run's last line (the verdict), then per variant the spread of the
CPU seconds (the command and every process it waited for: the pool's processes, the workers)
beside the wall seconds, the sum over the kinds named, and each whole command.  Wall seconds
are only comparable with the target on an idle machine: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.commands import Variant, interleaved, python  # noqa: E402

#: The previous behaviour's options: every cell, one process.
PREVIOUS = ["--full", "--jobs", "1"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", action="append", help="a kind (repeatable; default: all)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-previous", action="store_true",
                   help="time the default matrix alone")
    args = p.parse_args(argv)
    env = {"PYTHONPATH": str(REPO)}
    variants: list[tuple[str, Variant]] = []
    for kind in args.kind or ["all"]:
        command = [python(), "-m", "tyingspec", "mutants", "--kind", kind]
        variants.append(("default", Variant(f"default --kind {kind}", command, REPO, env)))
        if not args.no_previous:
            variants.append(("previous", Variant(f"previous --kind {kind}",
                                                 [*command, *PREVIOUS], REPO, env)))
    interleaved([v for _, v in variants], args.rounds)
    print(f"sum over the kinds named (median of each), {os.cpu_count()} cores:")
    for name in ("default", "previous"):
        mine = [v for n, v in variants if n == name]
        if mine:
            cpu = sum(sorted(v.cpu)[len(v.cpu) // 2] for v in mine)
            wall = sum(sorted(v.wall)[len(v.wall) // 2] for v in mine)
            print(f"  {name:<8}  CPU {cpu:8.1f} s   wall {wall:8.1f} s")
    return max(v.last.returncode if v.last else 1 for _, v in variants)


if __name__ == "__main__":
    sys.exit(main())
