"""What running user code in a worker process costs per call.

    python -m benchmarks.bench_isolation [--repeats 5 --calls 200] [--skip-small]
    python -m benchmarks.bench_isolation --skip-small --gpt2-repeats 5   # GPT-2 size only

For a model adapter (tyingspec's built-in ``untied-sum``, loaded as ``module:attr`` so it takes
the isolated path) it times, interleaved over ``--repeats`` rounds, ``--calls`` calls of
``tyingspec._src.engine.observe.call`` in-process and through the worker, at a property-sized batch
(V=32, d=8, N=12) and at a larger one (V=4096, d=256, N=512), and prints the per-call median,
min and max and the difference (the isolation's cost: pickling the inputs and outputs through
a pipe).  It also times starting the worker (a fresh interpreter, imports).

At GPT-2 size (V=50257, d=768, float32; ``--gpt2-repeats 0`` skips it) it times the two calls
``tyingspec check benchmarks.torch_probe:tied_f32 --precision float32 --shape 50257,768,1024``
makes: the first on the ``absent-tokens`` batch (N=1024), the second at E after one SGD step
on its first ``SECOND_CALL_POSITIONS`` (16) positions.  Each round, interleaved: both calls
of the bare function in a freshly spawned process, then both through a freshly started worker
(as each check starts one; the starts are not timed), so that both first calls pay torch's
first-call costs.  The
overhead of a call is the worker's time minus the bare function's in the same round: sending
the inputs, the adapter's copies and validation, and bringing dE back.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from tyingspec import Case, build, load
from tyingspec._src.core.cases import Batch, at_shape, sgd_step, standard_cases
from tyingspec._src.engine.observe import SECOND_CALL_POSITIONS, Target, call


def _per_call(target: Target, case: Case, calls: int) -> float:
    batch = build(case)
    t0 = time.perf_counter()
    for _ in range(calls):
        call(target, batch)
    return (time.perf_counter() - t0) / calls


def _spread(xs: list[float]) -> str:
    return (f"median {statistics.median(xs) * 1e3:8.3f} ms  min {min(xs) * 1e3:8.3f} ms  "
            f"max {max(xs) * 1e3:8.3f} ms")


GPT2_SPEC = "benchmarks.torch_probe:tied_f32"


def _first_batch() -> Batch:
    """The batch of a GPT-2-size check's first call: the ``absent-tokens`` case in float32."""
    case = next(c for c in at_shape(standard_cases(0), 50257, 768, 1024)[0]
                if c.name == "absent-tokens")
    return build(replace(case, dtype="float32"))


def _second_batch(first: Batch, dE: Any) -> Batch:
    """The second call's: E after one SGD step along the first call's dE, on the first
    ``SECOND_CALL_POSITIONS`` positions."""
    moved = sgd_step(first, np.asarray(dE))
    assert moved is not None
    return replace(moved[0], tokens=moved[0].tokens[:SECOND_CALL_POSITIONS],
                   targets=moved[0].targets[:SECOND_CALL_POSITIONS])


def _bare(batch: Batch) -> tuple[float, Any]:
    from benchmarks.torch_probe import tied_f32

    t0 = time.perf_counter()
    out = tied_f32(batch.E, batch.W, batch.b, batch.tokens, batch.targets, res=batch.res,
                   s_in=batch.s_in)
    return time.perf_counter() - t0, out["dE"]


def _bare_calls() -> list[float]:
    """Both calls of the bare function in a fresh process, as the worker makes them: its
    first call pays torch's first-call costs too."""
    first = _first_batch()
    one, dE = _bare(first)
    two, _ = _bare(_second_batch(first, dE))
    return [one, two]


def _gpt2(repeats: int) -> None:
    """The two calls of a GPT-2-size check: the bare function and through the worker, each in
    a fresh process per round."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import torch

    first = _first_batch()
    calls = {"first call": first, "second call": _second_batch(first, _bare(first)[1])}
    bare: dict[str, list[float]] = {k: [] for k in calls}
    worker: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        # the bare calls' process builds its own batches from the same seed (not timed)
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            for name, seconds in zip(calls, pool.submit(_bare_calls).result()):
                bare[name].append(seconds)
        target = load(GPT2_SPEC, "model", "float32")
        try:
            for name, batch in calls.items():
                t0 = time.perf_counter()
                call(target, batch)
                worker[name].append(time.perf_counter() - t0)
        finally:
            target.close()
            time.sleep(1.0)  # the closed worker's exit (torch's finalisers) is not timed
    print(f"== V=50257 d=768 float32, {GPT2_SPEC}, {repeats} rounds (torch {torch.__version__})")
    for name in calls:
        gaps = [w - b for w, b in zip(worker[name], bare[name])]
        print(f"  {name}: bare function {_spread(bare[name])}")
        print(f"  {'':11} worker call   {_spread(worker[name])}")
        print(f"  {'':11} overhead      {_spread(gaps)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--skip-small", action="store_true",
                    help="only the GPT-2-size calls")
    ap.add_argument("--gpt2-repeats", type=int, default=5,
                    help="rounds of the GPT-2-size calls (0: skip them)")
    a = ap.parse_args()
    if a.gpt2_repeats:
        _gpt2(a.gpt2_repeats)
    if a.skip_small:
        return
    # a correct model adapter, by module:attr
    spec = "tyingspec._src.kinds.probe.implementations:_untied_sum"
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
            ("in-process", partial(_per_call, inproc, case, calls)),
            ("worker", partial(_per_call, isolated, case, calls))]
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
    print(f"starting a worker (a fresh interpreter, imports, signature check): {_spread(starts)}")


if __name__ == "__main__":
    main()
