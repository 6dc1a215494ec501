"""Where the CPU seconds a cold `tyingspec check` adds to (F) go: §1's budget, part by part.

    python -m benchmarks.bench_check_budget --repeats 3
    python -m benchmarks.bench_check_budget --V 2000 --d 64 --N 256   # quick

§1 asks that the check add at most 0.5 (a) to (F) in wall time (``bench_check``'s names: (a)
one forward+backward in process, (b) the whole command, (F) a fresh process that imports the
target, builds the batch and calls it once).  On C cores that leaves the check at most
0.5 (a) C CPU seconds beyond (F)'s, plus what (F) leaves idle, C (F) − CPU(F) (its import runs
on one core): the allowance.  However well its parts are packed on the cores, a check whose
CPU seconds beyond (F) exceed the allowance cannot meet §1.

Each round runs (a), (F) and (b) back to back, with their CPU seconds (user + system, of every
process and thread), then every part of what the check adds, one after another in this process
and nothing beside it, through the engine's own functions, each in CPU seconds:

- the first call's reference at one BLAS thread, as the engine builds it beside the worker
  (``engine.observe._Building``): its two V·d·N products, and the rest of it (the softmax, the
  rounding bound's terms, the sketch's projections, the paths);
- the call's E written into a shared block as the engine writes it (``Worker._written``: a new
  block for the first call, the same block for the second), compared with that block after the
  call (``_written_over``: a write into an input is found there), and its dE written into a
  fresh result block in the worker (``engine.isolation._write_result``), for both calls;
- the first judgement, the SGD step, the second call (the implementation's own, in this
  process), and the second call's reference and judgement.

It prints each part (min, median and max over the rounds, with the median of its system
seconds and minor page faults: on a VM each fresh page is a fault and a zeroing in the kernel),
their sum, (b) − (F) as measured, the
difference (what no part accounts for when both processes share the cores: the worker's threads
waiting on each other beside this process's work, caches and pages cold in a fresh process, the
exits), and the allowance.  Last, the whole processes (a), (F) and (b) the same way: what (b)
uses beyond (F) in system seconds and faults is mostly the worker's (``perf record -e
page-faults`` on one check: 92% of its faults are the worker's), so mostly the implementation's
own second call.  The parts run warm, in a process that has run them before.
"""

from __future__ import annotations

import functools
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/bench_check_budget.py` as well as `-m`
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.bench_check import (  # noqa: E402
    Use,
    absent_tokens_batch,
    check_argv,
    floor_argv,
    forward_backward,
    ran,
    run_cli,
    timed,
    timed_process,
    usage,
)
from benchmarks.launch import shape_parser  # noqa: E402
from tyingspec._src.core import paths, threads  # noqa: E402
from tyingspec._src.core.adapters import Returned  # noqa: E402
from tyingspec._src.core.cases import Batch, sgd_step  # noqa: E402
from tyingspec._src.core.tolerance import Precision  # noqa: E402
from tyingspec._src.engine import isolation  # noqa: E402
from tyingspec._src.engine.observe import SECOND_CALL_POSITIONS, judge  # noqa: E402
from tyingspec._src.kinds.table import KINDS  # noqa: E402

PRECISION: Precision = "float32"


def cpu_of(f: Callable[[], Any]) -> tuple[Use, Any]:
    """What this process (all its threads) used in ``f()``, and what it returned."""
    u0 = usage()
    out = f()
    return usage() - u0, out


def staged(worker: isolation.Worker, E: np.ndarray) -> dict[str, Any]:
    """A call's ``E`` written into a shared block as ``worker`` writes a call's large inputs
    (``Worker._written``; nothing is started): a new block, or its pool's block of that size.
    Returns the blocks written, for the comparison after the call."""
    return worker._written({"E": E})[1]


def compared(E: np.ndarray, written: dict[str, Any]) -> None:
    """``E`` compared with its block after the call, as ``Worker.collect`` finds a write."""
    assert not isolation._written_over({"E": E}, written)


def written_back(a: np.ndarray) -> None:
    """``a`` written into a fresh result block, as the worker returns a large dE."""
    block = isolation._create(a.nbytes, populate=False)
    try:
        isolation._write_result(a, block)
    finally:
        isolation._release([block], unlink=True)


def returned(out: Any) -> Returned:
    """What the engine makes of ``tied_f32``'s answer, for the judgement."""
    return Returned(dE=np.asarray(out["dE"]), mutated=(), precision=PRECISION,
                    loss=float(out["loss"]), dW=np.asarray(out["dW"]),
                    db=None if out["db"] is None else np.asarray(out["db"]))


def parts(batch: Batch) -> dict[str, Use]:
    """Every part of what the check adds to (F), one after another, and what each used."""
    table = KINDS["model"]
    inputs = table.inputs(batch)
    t, y = paths.flatten_batch(batch.tokens, batch.targets)
    x = np.float32(batch.s_in) * batch.E[t]
    h = np.float32(batch.res) * x + np.tanh(x @ batch.W)
    used: dict[str, Use] = {}
    factors = batch.e_factors()  # the products as the reference computes them
    with threads.blas_on_one_core():
        first, g = cpu_of(lambda: paths._times_rows_T(h, batch.E, factors))
        second, _ = cpu_of(functools.partial(paths._times_rows, g, batch.E, factors))
        del g  # the reference below makes its own
        whole, ref = cpu_of(lambda: table.reference(batch, inputs, PRECISION, None))
    used["reference: its two products, one thread"] = first + second
    used["reference: the rest (softmax, bound terms, projections)"] = whole - first - second
    pool = isolation.Worker("budget:none", "model")  # its pool only: no process
    used["E written into a new shared block"], written = cpu_of(lambda: staged(pool, batch.E))
    used["E compared with its block after the call"], _ = cpu_of(
        lambda: compared(batch.E, written))
    ans = returned(forward_backward(batch)())  # the first call: (F) has it
    used["dE written into a result block (worker)"], _ = cpu_of(lambda: written_back(ans.dE))
    used["the first judgement"], _ = cpu_of(lambda: judge(ans, ref, PRECISION))
    used["the SGD step"], moved = cpu_of(lambda: sgd_step(batch, ans.dE))
    assert moved is not None
    stepped = moved[0]
    keep = min(SECOND_CALL_POSITIONS, stepped.tokens.shape[0])
    short = replace(stepped, tokens=stepped.tokens[:keep], targets=stepped.targets[:keep])
    used["E after the step written into that block"], written = cpu_of(
        lambda: staged(pool, short.E))
    used["E after the step compared with its block"], _ = cpu_of(
        lambda: compared(short.E, written))
    isolation._release(pool._pool, unlink=True)
    used["the second call (the implementation's own)"], out2 = cpu_of(forward_backward(short))
    ans2 = returned(out2)
    used["its dE written into a result block (worker)"], _ = cpu_of(
        lambda: written_back(ans2.dE))
    used["its reference and judgement"], _ = cpu_of(lambda: judge(
        ans2, table.reference(short, table.inputs(short), PRECISION, None), PRECISION))
    return used


def median_of(uses: Sequence[Use], field: str) -> float:
    return float(statistics.median(getattr(u, field) for u in uses))


def spread(xs: Sequence[float]) -> str:
    return f"{min(xs):6.2f} {statistics.median(xs):6.2f} {max(xs):6.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    a = shape_parser(__doc__).parse_args(argv)
    shape = (a.V, a.d, a.N)
    cores = threads.cores()
    batch = absent_tokens_batch(shape, 0)
    fb = forward_backward(batch)
    fb()  # warm-up, as bench_check's (a)
    parts(batch)  # and the parts: every round times them warm
    wall: dict[str, list[float]] = {"a": [], "F": [], "b": []}
    use: dict[str, list[Use]] = {"a": [], "F": [], "b": []}
    got: dict[str, list[Use]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        argv_b = check_argv("tied_f32", shape, "absent-tokens", PRECISION, Path(tmp) / "b.json")
        processes: list[tuple[str, Callable[[], float]]] = [
            ("F", lambda: timed_process(floor_argv(shape))),
            ("b", lambda: ran(run_cli(argv_b), 0).seconds)]
        for _ in range(a.repeats):
            u0 = usage()
            wall["a"].append(timed(fb))
            use["a"].append(usage() - u0)
            for name, run in processes:
                u0 = usage(resource.RUSAGE_CHILDREN)
                wall[name].append(run())
                use[name].append(usage(resource.RUSAGE_CHILDREN) - u0)
            for k, used in parts(batch).items():
                got.setdefault(k, []).append(used)
    V, d, N = shape
    print(f"== §1's CPU budget at V={V} d={d} N={N}, {PRECISION}, {a.repeats} rounds, "
          f"{cores} cores")
    print(f"{'CPU s: min median max':>22}  {'system s':>8}  {'faults':>7}  part of what the "
          "check adds (in this process, alone; system seconds and minor faults: medians)")
    for k, v in got.items():
        print(f"{spread([u.cpu for u in v]):>22}  {median_of(v, 'system'):8.2f}  "
              f"{median_of(v, 'faults'):7.0f}  {k}")
    med = {k: statistics.median(u.cpu for u in v) for k, v in got.items()}
    total = sum(med.values())
    must = med["reference: its two products, one thread"] + \
        med["the second call (the implementation's own)"]
    added = [b - f for b, f in zip(use["b"], use["F"])]
    added_cpu = [u.cpu for u in added]
    idle = [cores * w - u.cpu for w, u in zip(wall["F"], use["F"])]
    allowed = [0.5 * w * cores + i for w, i in zip(wall["a"], idle)]
    print(f"{total:22.2f}  the parts, summed (medians); of it the two products and the second "
          f"call, which any check makes: {must:.2f}")
    print(f"{spread(added_cpu):>22}  {median_of(added, 'system'):8.2f}  "
          f"{median_of(added, 'faults'):7.0f}  (b) - (F) measured, round by round (wall time: "
          f"(b) {statistics.median(wall['b']):.2f} s, (F) {statistics.median(wall['F']):.2f} s, "
          "medians)")
    print(f"{statistics.median(added_cpu) - total:22.2f}  in (b) - (F) but in no "
          "part (two processes on the cores, cold caches and pages, the exits): median")
    print(f"{spread(allowed):>22}  what §1's 0.5x allows: 0.5 (a) x {cores} cores + what (F) "
          f"leaves idle ({spread(idle)}), round by round")
    beyond = [x - al for x, al in zip(added_cpu, allowed)]
    print(f"{spread(beyond):>22}  (b) - (F) beyond that allowance, round by round: above 0 no "
          "ordering of the check's work on the cores can meet §1")
    print("whole processes (medians):")
    for name, what in (("a", "one forward+backward, in this process"),
                       ("F", "a fresh process: import the target, build the batch, one call"),
                       ("b", "the whole check (this process and its worker)")):
        print(f"{statistics.median(u.cpu for u in use[name]):22.2f}  "
              f"{median_of(use[name], 'system'):8.2f}  {median_of(use[name], 'faults'):7.0f}  "
              f"({name}) {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
