"""Where a linear-ce check's peak memory is reached: resident memory sampled per engine phase.

    python -m benchmarks.bench_memory_phases                           # V=32768 d=2048 N=1024
    python -m benchmarks.bench_memory_phases --V 128256 --d 4096       # Llama-3's head (minutes)
    python -m benchmarks.bench_memory_phases --V 128256 --d 4096 --precision bfloat16

Runs ``tyingspec check ce-torch --kind linear-ce --shape V,d,N --precision P --case
ce-plain --shrink-budget 0`` (``--precision``: float32, or bfloat16) in this process
(``front.cli.main``; a built-in target runs in the checking process, so its memory is this
process's), samples the resident set size every 20 ms
from a thread, and prints the largest sample seen inside each nesting of engine phases: the
first call (``first_call``), the repeat call (``observe/_invoke``: the implementation's own
forward+backward while the first call's judged arrays are held), judging (``complete``: the
reference, the kernel's findings, the tied total).  Read it beside ``bench_memory``'s (own)
peak at the same shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tyingspec._src.engine.observe as ob  # noqa: E402
import tyingspec._src.kinds.linear_ce.kind as kind  # noqa: E402
from benchmarks.bench_check_timeline import quiet_command  # noqa: E402
from tyingspec._src.kinds.table import KINDS as KIND_TABLE  # noqa: E402

STACK: list[str] = []


def entered(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        STACK.append(label)
        try:
            return f(*a, **k)
        finally:
            STACK.pop()
    return wrapper


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args(argv)
    for name in ("first_call", "observe", "judge", "_invoke"):
        setattr(ob, name, entered(name, getattr(ob, name)))
    for name in ("_reference", "_kernel_findings"):
        setattr(kind, name, entered(name, getattr(kind, name)))
    complete = entered("complete", kind.complete)
    object.__setattr__(KIND_TABLE["linear-ce"], "complete", complete)
    peak: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            where, now = "/".join(STACK) or "(outside the case)", rss()
            peak[where] = max(peak.get(where, 0), now)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, verdict = quiet_command(["check", "ce-torch", "--kind", "linear-ce", "--shape",
                                f"{a.V},{a.d},{a.N}", "--precision", a.precision, "--case",
                                "ce-plain", "--shrink-budget", "0", "--json", os.devnull])
    done.set()
    thread.join()
    size = 4 if a.precision == "float32" else 2
    print(f"== linear-ce check of ce-torch at V={a.V} d={a.d} N={a.N}, {a.precision}: "
          f"E is {a.V * a.d * size / 2**30:.2f} GiB; {verdict}")
    for where, most in sorted(peak.items(), key=lambda kv: -kv[1]):
        print(f"{most / 2**30:7.2f} GiB  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
