"""Warm runs: what one more case costs when the target's worker is already loaded (issue 23 §4).

Run from the repository root::

    python -m benchmarks.bench_warm                          # V=50257 d=768 N=1024 (GPT-2)
    python -m benchmarks.bench_warm --V 2000 --d 64 --N 256 --repeats 3

In one process, interleaved over ``--repeats`` rounds (a, W, a, W, ...):

- (a) one forward+backward of ``benchmarks.torch_probe:tied_f32`` in this process, on the float32
  batch the check's ``absent-tokens`` case builds at that shape (after one untimed warm-up);
- (W) ``tyingspec.check("benchmarks.torch_probe:tied_f32", precision="float32",
  cases=[absent-tokens at that shape], shrink_budget=0)`` with the worker already loaded by an
  untimed first check: the per-case cost a user's test (or the pytest plugin, whose session
  fixture keeps one worker per xdist process the same way) pays for every case after the first.

Prints min/median/max of each and median(W)/median(a) (the issue's target is at most 2x), each
round's own W/a (the machine's drift between rounds cancels in it), and
beside them, interleaved in the same rounds, the parts of a warm case no check can skip
(``bench_check.floor_parts``: the reference's two products, the second call, drawing the
batch) with their sum as a multiple of (a).

Then what deciding to reuse the loaded worker costs a warm case (issue 50): comparing the
digests of the files its code came from with those files as they are now, and looking for a
process its target left running (``Worker.current`` and ``Worker.strays``, 20 times each).

Last, the CPU seconds (user + system, every thread) of (a), of each floor part (this process)
and of W (this process and the worker, read from ``/proc``), and what they allow on the
machine's cores however the work is ordered: the least W / (a) that W's own CPU seconds
permit, and the CPU floor, the least W / (a) of a warm case that did nothing but the floor's
parts (the call, the reference's two products, the second call, the batch), packed onto every
core with no gap, the products counted at the less of what they cost on every core and on one
(``floor_parts``' (R1)).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_check import (  # noqa: E402
    absent_tokens_batch,
    floor_parts,
    forward_backward,
    live_children_cpu,
    paired,
    print_floor,
    spread,
)
from benchmarks.launch import shape_parser  # noqa: E402
from tyingspec import check, standard_cases  # noqa: E402
from tyingspec._src.core import threads  # noqa: E402
from tyingspec._src.core.cases import at_shape  # noqa: E402

TARGET = "benchmarks.torch_probe:tied_f32"


def print_cpu(fa: list[float], cpu: dict[str, list[float]]) -> None:
    """What the CPU seconds of each round allow on this machine's cores: a case takes at least
    its CPU seconds over the cores, and a case made of the floor's parts alone at least theirs
    (the worker's call costs what (a) costs in process: the same code on the same batch)."""
    cores = threads.cores()  # what the check spreads its own passes over, as torch does
    print(f"CPU seconds, user + system: (a) {spread(cpu['a'])}")
    print(f"                            (W) {spread(cpu['W'])}  (this process and the worker)")
    for k in ("R", "R1", "2", "D"):
        print(f"                            ({k}) {spread(cpu[k])}")
    print(paired(f"the least (W) / (a) that W's CPU seconds allow on {cores} cores, round by "
                 "round", [w / cores / a for w, a in zip(cpu["W"], fa)]))
    floor = [sum(cpu[k][i] for k in ("a", "2", "D")) + min(cpu["R"][i], cpu["R1"][i])
             for i in range(len(fa))]
    print(paired(f"the CPU floor, (a) + (R) + (2) + (D) in CPU seconds over {cores} cores, (R) "
                 "at the less of its cost on every core and on one, over (a), round by round",
                 [f / cores / a for f, a in zip(floor, fa)]))


def main(argv: Sequence[str] | None = None) -> int:
    a = shape_parser(__doc__, repeats=5).parse_args(argv)
    shape = (a.V, a.d, a.N)
    cases, _ = at_shape(standard_cases(0), *shape)
    case = replace(next(c for c in cases if c.name == "absent-tokens"), dtype="float32")
    batch = absent_tokens_batch(shape, 0)
    fb = forward_backward(batch)
    fb()
    # (R1), the products on one core, is not part of the time floor (a warm case has no import
    # for them to hide beside), but it is what they cost in CPU seconds at the least: OpenBLAS's
    # two threads spend more on them, waits included.  It runs first in each round, so that W
    # follows the parts it followed before (R1) was timed here: OpenBLAS set to one thread and
    # back just before W may slow W (one run with (R1) last: W/(a) medians 2.95x and 2.71x;
    # two with it first: 2.72x and 2.69x)
    every = floor_parts(batch)
    parts = {"R1": every.pop("R1"), **every}
    part: dict[str, list[float]] = {k: [] for k in parts}
    t0 = time.perf_counter()
    first = check(TARGET, "model", precision="float32", cases=[case], shrink_budget=0,
                  paths=[str(REPO)])
    cold = time.perf_counter() - t0
    if not first.ok:
        print(first.diagnosis)
        return 1
    fa: list[float] = []
    warm: list[float] = []
    cpu: dict[str, list[float]] = {k: [] for k in ("a", "W", *parts)}

    def both() -> float:
        return time.process_time() + live_children_cpu()

    for _ in range(a.repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fb()
        fa.append(time.perf_counter() - t0)
        cpu["a"].append(time.process_time() - c0)
        for k, f in parts.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            part[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
        c0, t0 = both(), time.perf_counter()
        report = check(TARGET, "model", precision="float32", cases=[case], shrink_budget=0,
                       paths=[str(REPO)])
        warm.append(time.perf_counter() - t0)
        cpu["W"].append(both() - c0)
        assert report.ok, report.diagnosis
    print(f"== warm runs: V={a.V} d={a.d} N={a.N}, float32, {a.repeats} interleaved rounds")
    print(f"(a) one forward+backward of tied_f32, in process\n    {spread(fa)}")
    print(f"(W) one more tyingspec.check case, worker loaded (the first, cold: {cold:.2f} s)\n"
          f"    {spread(warm)}")
    ma = statistics.median(fa)
    print(f"median(W) / median(a) = {statistics.median(warm) / ma:.2f}x")
    print_floor(part, ma, {"(W) - (a), what a warm case adds": statistics.median(warm) - ma})
    print(paired("(W) / (a), round by round (a, the floor's parts and W back to back)",
                 [w / x for w, x in zip(warm, fa)]))
    floor = ma + sum(statistics.median(part[k]) for k in ("R", "2", "D"))
    print(f"floor of a warm case, (a) + (R) + (2) + (D) = {floor:.2f} s ({floor / ma:.2f}x); "
          f"(W) is {statistics.median(warm) / floor:.2f}x that floor")
    print_reuse()
    print_cpu(fa, cpu)
    return 0


def print_reuse(times: int = 20) -> None:
    """What a warm case pays to decide that the kept worker may serve it: the files its code
    came from compared with what they hold now, and the processes below the worker looked for
    (see ``engine.warm``)."""
    from tyingspec._src.engine.warm import WARM

    (target,) = WARM._kept.values()
    worker = target.worker
    assert worker is not None
    took: dict[str, list[float]] = {"current": [], "strays": []}
    for _ in range(times):
        for name, f in (("current", worker.current), ("strays", worker.strays)):
            t0 = time.perf_counter()
            f()
            took[name].append(time.perf_counter() - t0)
    print(f"reusing the worker: comparing the {len(worker.sources)} files its code came from "
          f"{statistics.median(took['current']) * 1e3:.2f} ms, looking for a process it left "
          f"{statistics.median(took['strays']) * 1e3:.2f} ms (medians of {times})")


if __name__ == "__main__":
    raise SystemExit(main())
