"""What `tyingspec check --kind linear-ce` costs against one call of the kernel it checks.

Run from the repository root::

    python -m benchmarks.bench_linear_ce                      # V=50257 d=768 N=1024, float32
    python -m benchmarks.bench_linear_ce --V 2000 --d 64 --N 256 --repeats 3

Interleaved over ``--repeats`` rounds (A, B, A, B, ...):

- (A) one call of the correct torch kernel (``ce-torch``: chunked, plain autograd, Liger's
  calling convention): construct, forward and backward on the float32 inputs of the check's
  ``ce-plain`` case at that shape, in this process, after one untimed warm-up call;
- (B) the whole command ``tyingspec check ce-torch --kind linear-ce --precision float32 --shape
  V,d,N --case ce-plain --shrink-budget 0``, as a subprocess.

It prints min/median/max of each and median(B)/median(A).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.launch import shape_parser, tyingspec_cmd  # noqa: E402


def one_call(shape: tuple[int, int, int]) -> object:
    """A zero-argument callable running the kernel once on the case's inputs."""
    from dataclasses import replace

    from tyingspec._src.core.cases import at_shape, build
    from tyingspec._src.kinds.linear_ce.adapter import call_linear_ce
    from tyingspec._src.kinds.linear_ce.kind import inputs, standard_ce_cases
    from tyingspec._src.kinds.linear_ce.spec import SPEC
    from tyingspec._src.kinds.linear_ce.zoo import ce_torch

    case = next(c for c in standard_ce_cases(0) if c.name == "ce-plain")
    (case,), _ = at_shape([case], *shape, SPEC)
    batch = build(replace(case, dtype="float32"), SPEC)
    inp = inputs(batch)
    return lambda: call_linear_ce("ce-torch", ce_torch, inp)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    args = shape_parser(__doc__).parse_args(argv)
    shape = (args.V, args.d, args.N)
    call = one_call(shape)
    call()  # type: ignore[operator]  # warm-up
    calls: list[float] = []
    checks: list[float] = []
    argv_b = [*tyingspec_cmd(), "check", "ce-torch", "--kind", "linear-ce", "--precision",
              "float32", "--shape", ",".join(map(str, shape)), "--case", "ce-plain",
              "--shrink-budget", "0"]
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        calls.append(time.perf_counter() - start)
        start = time.perf_counter()
        run = subprocess.run(argv_b, capture_output=True, text=True, cwd=REPO)
        checks.append(time.perf_counter() - start)
        if run.returncode != 0:
            raise SystemExit(f"the check exited {run.returncode}:\n{run.stdout[-3000:]}")
    print(f"linear-ce at V={args.V} d={args.d} N={args.N}, float32, {args.repeats} "
          "interleaved rounds")
    print(f"  (A) one call of ce-torch (forward + backward): {spread(calls)}")
    print(f"  (B) tyingspec check ce-torch --kind linear-ce:  {spread(checks)}")
    print(f"  (B) / (A): {statistics.median(checks) / statistics.median(calls):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
