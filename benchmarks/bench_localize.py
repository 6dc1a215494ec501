"""What localising wrong rows of dL/dE from the forward alone costs, against a full Jacobian.

Run from the repository root::

    python -m benchmarks.bench_localize                 # V in 64, 512, 4096, 32768; 3 seeds
    python -m benchmarks.bench_localize --seeds 5 --d 64 --N 64

For each V and k in (0, 1, 4) wrong rows it builds a probe-model batch (float64, E ~ N(0, 1),
``--N`` tokens drawn from ``N / 2`` ids so tokens repeat), breaks k rows of the closed-form
gradient by a relative error of 1e-4 of the row's norm (rows of ordinary size: at least 1e-3 of
the largest row), and runs :func:`core.localize.localize` once per seed.  It prints the
loss evaluations used (min / median / max over seeds), the directional tests, whether the rows
found were exactly the rows broken, the wall time of one localisation (median) and, side by
side, ``2 V d``: the evaluations a full central-difference Jacobian would need.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/bench_localize.py` as well as `python -m`
    sys.path.insert(0, str(REPO))

from tyingspec._src.core.localize import localize  # noqa: E402
from tyingspec._src.core.paths import closed_form_paths, loss_only  # noqa: E402


def one(V: int, d: int, N: int, k: int, seed: int) -> tuple[int, int, bool, float]:
    """(evaluations, tests, exactly the broken rows?, seconds) for one localisation."""
    r = np.random.default_rng(seed)
    E = r.normal(0.0, 1.0, (V, d))
    W = r.normal(0.0, 1 / math.sqrt(d), (d, d))
    b = r.normal(0.0, 0.1, V)
    tokens = r.integers(0, max(1, min(V, N // 2)), N)
    targets = r.integers(0, V, N)
    G = closed_form_paths(E, W, b, tokens, targets).dE
    norms = np.linalg.norm(G, axis=1)
    candidates = np.flatnonzero(norms >= 1e-3 * norms.max())
    wrong = np.sort(r.choice(candidates, min(k, candidates.size), replace=False))
    for v in wrong:
        e = r.standard_normal(d)
        G[v] += 1e-4 * norms[v] * e / np.linalg.norm(e)

    def loss_along(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        keep = E[rows].copy()
        E[rows] += t * D
        try:
            return loss_only(E, E, W, b, tokens, targets)
        finally:
            E[rows] = keep

    start = time.perf_counter()
    out = localize(loss_along, G, seed=seed, e_scale=1.0)
    seconds = time.perf_counter() - start
    return out.evaluations, out.probes, out.wrong_rows == tuple(wrong.tolist()), seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--V", type=int, nargs="+", default=[64, 512, 4096, 32768])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--N", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"localize on the probe model, float64, d={args.d} N={args.N}, "
          f"{args.seeds} seeds per row; wrong rows off by 1e-4 of their norm")
    head = (f"{'V':>6} {'k':>2} {'evals min/med/max':>18} {'tests':>6} {'exact':>6} "
            f"{'time/run':>9} {'ms/eval':>8} {'2*V*d':>9} {'2Vd/evals':>10}")
    print(head)
    print("-" * len(head))
    for V in args.V:
        for k in args.k:
            runs = [one(V, args.d, args.N, k, seed) for seed in range(args.seeds)]
            evals = sorted(e for e, _, _, _ in runs)
            tests = statistics.median(t for _, t, _, _ in runs)
            exact = sum(ok for _, _, ok, _ in runs)
            secs = statistics.median(s for _, _, _, s in runs)
            med = statistics.median(evals)
            jac = 2 * V * args.d
            print(f"{V:>6} {k:>2} {f'{evals[0]}/{med:g}/{evals[-1]}':>18} {tests:>6g} "
                  f"{f'{exact}/{len(runs)}':>6} {secs:>8.3f}s {1e3 * secs / med:>8.2f} "
                  f"{jac:>9} {jac / med:>9.0f}x", flush=True)


if __name__ == "__main__":
    main()
