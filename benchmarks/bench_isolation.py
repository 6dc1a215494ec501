"""What running user code in a worker process costs per call.

    python -m benchmarks.bench_isolation [--repeats 5 --calls 200]

For a model adapter (tyingspec's built-in ``untied-sum``, loaded as ``module:attr`` so it takes
the isolated path) it times, interleaved over ``--repeats`` rounds, ``--calls`` calls of
``tyingspec._engine.call`` in-process and through the worker, at a property-sized batch
(V=32, d=8, N=12) and at a larger one (V=4096, d=256, N=512), and prints the per-call median,
min and max and the difference (the isolation's cost: pickling the inputs and outputs through
a pipe).  It also times starting the worker (spawn + imports).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from tyingspec import Case, build, load
from tyingspec._engine import Target, call


def _per_call(target: Target, case: Case, calls: int) -> float:
    batch = build(case)
    t0 = time.perf_counter()
    for _ in range(calls):
        call(target, batch)
    return (time.perf_counter() - t0) / calls


def _spread(xs: list[float]) -> str:
    return (f"median {statistics.median(xs) * 1e3:8.3f} ms  min {min(xs) * 1e3:8.3f} ms  "
            f"max {max(xs) * 1e3:8.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    spec = "tyingspec._implementations:_untied_sum"  # a correct model adapter, by module:attr
    starts: list[float] = []
    t0 = time.perf_counter()
    isolated = load(spec, "model")
    starts.append(time.perf_counter() - t0)
    inproc = load(spec, "model", isolate=False)
    sizes: list[tuple[str, Case, int]] = [
        ("V=32 d=8 N=12", Case("small", V=32, d=8, N=12, seed=1), a.calls),
        ("V=4096 d=256 N=512", Case("large", V=4096, d=256, N=512, seed=1),
         max(3, a.calls // 50))]
    for label, case, calls in sizes:
        runs: dict[str, list[float]] = {"in-process": [], "worker": []}
        order: list[tuple[str, Callable[[], float]]] = [
            ("in-process", lambda c=case, n=calls: _per_call(inproc, c, n)),
            ("worker", lambda c=case, n=calls: _per_call(isolated, c, n))]
        for _ in range(a.repeats):  # interleaved: A, B, A, B, ...
            for name, fn in order:
                runs[name].append(fn())
        print(f"== {label}, {calls} calls per round, {a.repeats} rounds")
        for name, xs in runs.items():
            print(f"  {name:<10} per call: {_spread(xs)}")
        gap = statistics.median(runs["worker"]) - statistics.median(runs["in-process"])
        print(f"  isolation costs {gap * 1e3:.3f} ms per call (median difference)")
    isolated.close()
    for _ in range(a.repeats - 1):
        t0 = time.perf_counter()
        load(spec, "model").close()
        starts.append(time.perf_counter() - t0)
    print(f"starting a worker (spawn, imports, signature check): {_spread(starts)}")


if __name__ == "__main__":
    main()
