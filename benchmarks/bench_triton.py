"""A Triton kernel's whole check under the Triton interpreter, case by case, beside the
kernel's own call.

Run from the repository root, with the kernel importable (a released Liger, say, installed
with ``pip install --no-deps --target DIR liger-kernel==0.8.5``)::

    python -m benchmarks.bench_triton --path DIR
    python -m benchmarks.bench_triton --path DIR --target mypkg.kernels:MyLoss --cases ce-plain

For each case ``tyingspec check TARGET --kind linear-ce`` runs (the long case fitted to the
kernel's blocks, as the check fits it), it prints:

- *call*: one call of the kernel under the interpreter, in this process (``TRITON_INTERPRET=1``
  set before triton is imported, the gaps filled as the check fills them): construct, forward
  and backward on the case's own inputs, through the adapter the check calls it with (the
  faster of two calls, so no first-call cost is counted; the same for *torch*);
- *torch*: the same case through the zoo's plain-torch kernel (``ce-torch``) on the CPU: what
  the loss costs without the interpreter;
- *check*: that case's share of the whole check, ``tyingspec.check`` in its worker, from the
  end of the previous case to the end of this one (the first also loads the worker, imports
  the kernel and reads its blocks).

and the whole check's seconds, with call/torch (the interpreter's slowdown) and check/call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

LIGER = "liger_kernel.transformers:LigerFusedLinearCrossEntropyLoss"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=LIGER, help="module:attr (default: Liger's FLCE)")
    parser.add_argument("--path", action="append", default=[],
                        help="a folder the target imports from (repeatable)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--unfitted-long", action="store_true",
                        help="also time one call on the long case at its compiled-kernel "
                             "length (N = 8101), which the check does not run interpreted")
    args = parser.parse_args(argv)
    for p in reversed(args.path):
        sys.path.insert(0, os.path.abspath(p))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.abspath(p) for p in args.path] + [os.environ.get("PYTHONPATH", "")])

    from tyingspec import build  # a linear-ce case: the public build draws its options
    from tyingspec._src.engine.observe import described, load, shaped
    from tyingspec._src.front.check import CaseResult, check_target
    from tyingspec._src.kinds.linear_ce import interpreter
    from tyingspec._src.kinds.linear_ce.adapter import call_linear_ce
    from tyingspec._src.kinds.linear_ce.kind import inputs, standard_ce_cases
    from tyingspec._src.kinds.linear_ce.zoo import ce_torch
    from tyingspec._src.kinds.table import resolve

    cases = standard_ce_cases(0)
    if args.cases:
        wanted = args.cases.split(",")
        cases = [c for c in cases if c.name in wanted]
    # the cases as the check runs them: the kernel's options, the long case fitted
    target = load(args.target, "linear-ce")
    try:
        cases, notes = shaped(target, cases)
        info = described(target)
    finally:
        target.close()
    fn = resolve(args.target, "linear-ce")  # in this process, interpreted (set above)
    interpreter.install()
    def best(call: Callable[[], object]) -> float:  # the faster of two: no first-call costs
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return min(times)

    calls: dict[str, float] = {}
    torch_calls: dict[str, float] = {}
    for case in cases:
        inp = inputs(build(case))
        calls[case.name] = best(lambda inp=inp: call_linear_ce(args.target, fn, inp))
        torch_calls[case.name] = best(lambda inp=inp: call_linear_ce("ce-torch", ce_torch, inp))

    ends: list[tuple[CaseResult, float]] = []
    start = time.perf_counter()
    report = check_target(args.target, "linear-ce", 0, cases, shrink_budget=0,
                          on_result=lambda r: ends.append((r, time.perf_counter())))
    whole = time.perf_counter() - start

    print(f"{args.target} under the Triton interpreter of triton {info.get('interpreted')} "
          f"({os.cpu_count()} cores); filled: {'; '.join(info.get('filled') or []) or 'none'}")
    for note in notes:
        print(f"  {note}")
    print(f"{'case':32} {'N':>5} {'dtype':>9} {'call s':>8} {'torch s':>8} {'check s':>8} "
          f"{'call/torch':>10} {'check/call':>10}  status")
    last = start
    for r, end in ends:
        name, share = r.case.name, end - last
        last = end
        c, t = calls[name], torch_calls[name]
        print(f"{name:32} {r.case.N:>5} {r.case.dtype:>9} {c:8.2f} {t:8.3f} {share:8.2f} "
              f"{c / t:10.0f} {share / c:10.1f}  {r.status}")
    if args.unfitted_long:
        from tyingspec._src.kinds.linear_ce.kind import LONG_N

        long = next(c for c in standard_ce_cases(0) if c.name == "ce-long")
        inp = inputs(build(long))
        t0 = time.perf_counter()
        call_linear_ce(args.target, fn, inp)
        print(f"ce-long at N={LONG_N} (what a compiled kernel is checked on): one call "
              f"{time.perf_counter() - t0:.1f} s under the interpreter")
    total_calls = sum(calls.values())
    print(f"whole check: {whole:.1f} s for {len(ends)} cases (exit {report.exit_code}); the "
          f"kernel's calls alone {total_calls:.1f} s; plain torch "
          f"{sum(torch_calls.values()):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
