"""Timing whole commands as a user runs them: wall seconds and CPU seconds (user + system of the
command and every descendant it waited for, from ``getrusage(RUSAGE_CHILDREN)``), so that a
loaded machine's share of the cores cancels out of the CPU figure.

Used by ``bench_plugin_quickstart``, ``bench_quick_check`` and ``bench_suite``: each names the
variants it compares (a command, its environment and its directory), runs them interleaved
round by round (A, B, A, B, ...: the machine's drift falls on each alike) and prints each
variant's whole command and the spread (min, median, max) of its wall and CPU seconds.
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Variant:
    """One command to time: ``argv`` run in ``cwd`` with ``env`` added to this environment;
    ``before`` (if any) runs ahead of each timed run, untimed (e.g. to empty a cache)."""

    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    before: Callable[[], None] | None = None
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    last: subprocess.CompletedProcess[str] | None = None

    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"(cd {shlex.quote(str(self.cwd))} && {env + ' ' if env else ''}" \
            f"{shlex.join(self.argv)})"

    def run(self) -> None:
        if self.before is not None:
            self.before()
        start = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        self.last = subprocess.run(self.argv, cwd=self.cwd, env={**os.environ, **self.env},
                                   capture_output=True, text=True, check=False)
        self.wall.append(time.perf_counter() - t0)
        end = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu.append(end.ru_utime - start.ru_utime + end.ru_stime - start.ru_stime)


def spread(xs: Sequence[float]) -> str:
    return f"min {min(xs):6.2f}  median {statistics.median(xs):6.2f}  max {max(xs):6.2f}"


def interleaved(variants: Sequence[Variant], rounds: int) -> None:
    """Each variant once a round, ``rounds`` rounds, then the figures side by side."""
    for r in range(rounds):
        for v in variants:
            v.run()
            assert v.last is not None
            tail = (v.last.stdout.strip().splitlines() or [""])[-1]
            print(f"round {r + 1} {v.name}: {v.wall[-1]:.2f} s wall, {v.cpu[-1]:.2f} CPU-s, "
                  f"exit {v.last.returncode}: {tail}", flush=True)
    print(f"\n{os.cpu_count()} cores; load average before the last round "
          f"{os.getloadavg()[0]:.1f}; {rounds} rounds interleaved; seconds:")
    width = max(len(v.name) for v in variants)
    for v in variants:
        print(f"  {v.name:<{width}}  CPU {spread(v.cpu)}   wall {spread(v.wall)}")
    print("commands:")
    for v in variants:
        print(f"  {v.name}: {v.command()}")


def interleaved_in(scratch: Path, variants: Sequence[Variant], rounds: int) -> int:
    """:func:`interleaved`, then ``scratch`` (the benchmark's files and caches) removed however
    it ended; the worst exit status of the variants' last runs."""
    try:
        interleaved(variants, rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return max(v.last.returncode if v.last else 1 for v in variants)


def python() -> str:
    return sys.executable
