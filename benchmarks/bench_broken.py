"""A broken kernel against a correct one, over every case `tyingspec check` runs, shrinking
included (issue 23 §2).

Run from the repository root::

    python -m benchmarks.bench_broken                          # --shape 50257,768,1024
    python -m benchmarks.bench_broken --shape 2000,64,256 --repeats 3

Interleaved over ``--repeats`` rounds, each a subprocess of the whole command
``tyingspec check NAME --kind kernel --shape V,d,N`` with the default shrink budget, for the
correct built-in ``tied`` and three broken ones: ``output-path-only`` (the input path dropped),
``duplicates-buffered`` (numpy's buffered ``+=``) and ``paths-averaged`` (both paths halved).
Prints min/median/max of each, its label and what shrinking did, and median(broken) /
median(correct); the issue's target is at most 1.5x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_check import spread  # noqa: E402
from benchmarks.launch import tyingspec_cmd  # noqa: E402

NAMES = ("tied", "output-path-only", "duplicates-buffered", "paths-averaged")


def run(name: str, shape: str, out: Path) -> tuple[float, dict]:  # type: ignore[type-arg]
    argv = tyingspec_cmd() + ["check", name, "--kind", "kernel", "--shape", shape,
                              "--json", str(out)]
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    return time.perf_counter() - t0, json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="50257,768,1024")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    last: dict[str, dict] = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeats):
            for name in NAMES:
                t, report = run(name, a.shape, Path(tmp) / "r.json")
                times[name].append(t)
                last[name] = report
    print(f"== tyingspec check NAME --kind kernel --shape {a.shape}, every case, default shrink "
          f"budget, {a.repeats} interleaved rounds")
    base = statistics.median(times["tied"])
    for name in NAMES:
        rep = last[name]
        notes = sorted({c.get("shrink_note", "") or ("shrunk" if "smallest_batch" in c else "")
                        for c in rep["cases"]} - {""})
        print(f"{name:<20} {spread(times[name])}  -> {rep['diagnosis']}, "
              f"{len(rep['cases'])} cases; x{statistics.median(times[name]) / base:.2f} the "
              "correct one")
        for n in notes:
            print(f"{'':<22}{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
