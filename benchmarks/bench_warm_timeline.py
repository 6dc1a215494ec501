"""A warm case at GPT-2 size in both processes: the timeline and the CPU each used.

    python -m benchmarks.bench_warm_timeline --rounds 5

Checks ``benchmarks.timed_probe:tied_f32`` (``torch_probe.tied_f32``, its calls timed inside
the worker) once to load the worker, then ``--rounds`` warm cases.  It prints min, median and
max over the rounds of: the whole case; the implementation's two calls as timed inside the
worker; the first call's judgement; the worker's own steps after each call (from the
implementation's return to the answer read here: the result block made and dE written into
it, the answer sent and taken); and the CPU seconds of this process and of the worker.  Then
the timeline of the last case, each phase as (start, end, seconds) from the case's start, this
process's phases and the worker's on one clock.  On two cores a case can take no less than the
two processes' CPU seconds over 2: the last line says how close it came.  (At e56a8ae, where
the engine sent the second call before the first was judged, this script compared the two
orders; see docs/speed.md.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tyingspec._src.engine.isolation as iso  # noqa: E402
import tyingspec._src.engine.observe as ob  # noqa: E402
from benchmarks.bench_check import live_children_cpu, spread  # noqa: E402
from benchmarks.bench_check_timeline import wrapped  # noqa: E402
from tyingspec import check, standard_cases  # noqa: E402
from tyingspec._src.core.cases import at_shape  # noqa: E402
from tyingspec._src.kinds.table import KINDS as KIND_TABLE  # noqa: E402

TARGET = "benchmarks.timed_probe:tied_f32"
Event = tuple[str, float, float]  # (phase, start, end)
EVENTS: list[Event] = []


def _timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    return wrapped(label, f, lambda s, dt, name: EVENTS.append((name, s, s + dt)))


def _instrument() -> None:
    for name, label in (("batch_for", "batch"), ("judge", "judge"), ("sgd_step", "SGD step")):
        setattr(ob, name, _timed(label, getattr(ob, name)))
    table = KIND_TABLE["model"]
    object.__setattr__(table, "reference", _timed("reference", table.reference))
    iso.Worker.submit = _timed("send a call", iso.Worker.submit)  # type: ignore[method-assign]
    iso.Worker.collect = _timed("wait for its answer",  # type: ignore[method-assign]
                                iso.Worker.collect)


def _worker_events(log: Path, t0: float) -> list[Event]:
    out = []
    for line in log.read_text().splitlines():
        label, s, e, _ = line.rsplit(" ", 3)
        out.append((f"worker: {label}" if label.startswith("call") else label, float(s), float(e)))
    return [ev for ev in out if ev[1] >= t0]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    fd, name = tempfile.mkstemp(prefix="tyingspec-bench-", suffix=".log")
    os.close(fd)
    log = Path(name)
    os.environ["TYINGSPEC_BENCH_LOG"] = name  # the worker inherits it
    try:
        return _run(a.rounds, log)
    finally:
        log.unlink(missing_ok=True)


def _run(rounds: int, log: Path) -> int:
    _instrument()
    cases, _ = at_shape(standard_cases(0), 50257, 768, 1024)
    case = replace(next(c for c in cases if c.name == "absent-tokens"), dtype="float32")

    def run() -> bool:
        return check(TARGET, "model", precision="float32", cases=[case], shrink_budget=0,
                     paths=[str(REPO)]).ok

    if not run():
        print("the warm-up check was not correct")
        return 1
    f: dict[str, list[float]] = {}
    last: list[Event] = []
    for _ in range(rounds):
        EVENTS.clear()
        log.write_text("")
        c0, w0, t0 = os.times(), live_children_cpu(), time.perf_counter()
        ok = run()
        t1, c1, w1 = time.perf_counter(), os.times(), live_children_cpu()
        if not ok:
            print("a warm case was not correct")
            return 1
        events = sorted(EVENTS + _worker_events(log, t0), key=lambda ev: ev[1])
        calls = [ev for ev in events if ev[0].startswith("worker: call")]
        waits = [ev for ev in events if ev[0] == "wait for its answer"]
        judged = [ev for ev in events if ev[0] == "judge"]
        for key, value in (
                ("the whole case", t1 - t0),
                ("the first call, in the worker", calls[0][2] - calls[0][1]),
                ("the second call, in the worker", calls[1][2] - calls[1][1]),
                ("the first call's judgement", judged[0][2] - judged[0][1]),
                ("after each call: its return to its answer read here",
                 sum(w[2] - c[2] for c, w in zip(calls, waits)) / len(calls)),
                ("CPU seconds, this process", c1.user + c1.system - c0.user - c0.system),
                ("CPU seconds, the worker", w1 - w0)):
            f.setdefault(key, []).append(value)
        last = [(n, s - t0, e - t0) for n, s, e in events]
    print(f"== warm cases at V=50257 d=768 N=1024 float32, {rounds} rounds")
    for key, values in f.items():
        print(f"{key:<54} {spread(values)}")
    print("\ntimeline of the last case (start, end, seconds):")
    for n, s, e in last:
        print(f"  {s:6.3f} {e:6.3f} {e - s:6.3f}  {n}")
    cpu = statistics.median([x + y for x, y in zip(f["CPU seconds, this process"],
                                                   f["CPU seconds, the worker"])])
    whole = statistics.median(f["the whole case"])
    print(f"both processes used {cpu:.2f} CPU seconds (median), so a case on 2 cores takes at "
          f"least {cpu / 2:.2f} s; it took {whole:.2f} s ({100 * cpu / 2 / whole:.0f}% of both "
          "cores busy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
