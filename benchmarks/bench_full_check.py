"""Full row-by-row check at GPT-2 sizes vs one forward+backward of the built-in implementation.

    python benchmarks/bench_full_check.py [--V 50257 --d 768 --N 1024 --repeats 3]

Prints the wall time of (a) one forward+backward of the built-in tied numpy model, (b) the
closed-form two-path reference, (c) the diagnosis of every row of dE, and (b+c)/(a).
"""

from __future__ import annotations

import argparse
import time

from tyingspec import Case, build, closed_form_paths, diagnose
from tyingspec._src.kinds.probe.builtins import REGISTRY


def _best(f, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--V", type=int, default=50257)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    case = Case("gpt2", V=a.V, d=a.d, N=a.N, seed=a.seed, bias=False)
    b = build(case)
    b = type(b)(b.E * 0.02, b.W, b.b, b.tokens, b.targets, 1.0, 1.0)  # GPT-2's init scale
    model = REGISTRY["tied"].model
    assert model is not None
    t_fb, out = _best(lambda: model(b.E, b.W, b.b, b.tokens, b.targets, res=1.0, s_in=1.0),
                      a.repeats)
    t_ref, paths = _best(lambda: closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets),
                         a.repeats)
    t_diag, diag = _best(lambda: diagnose(out["dE"], paths), a.repeats)  # type: ignore[index]
    broken = REGISTRY["output-path-only"].model
    assert broken is not None
    bad = broken(b.E, b.W, b.b, b.tokens, b.targets, res=1.0, s_in=1.0)
    t_bad, bdiag = _best(lambda: diagnose(bad["dE"], paths), a.repeats)
    print(f"V={a.V} d={a.d} N={a.N} float64, best of {a.repeats}, seed {a.seed}")
    print(f"{'one forward+backward (built-in tied numpy)':<48} {t_fb * 1e3:9.1f} ms")
    print(f"{'closed-form two-path reference':<48} {t_ref * 1e3:9.1f} ms")
    print(f"{'diagnosis of every row (correct dE)':<48} {t_diag * 1e3:9.1f} ms"
          f"   -> {diag.label}")  # type: ignore[attr-defined]
    print(f"{'diagnosis of every row (input path dropped)':<48} {t_bad * 1e3:9.1f} ms"
          f"   -> {bdiag.label}, {bdiag.rows_wrong} wrong rows")  # type: ignore[attr-defined]
    total = t_ref + t_diag
    print(f"{'full check (reference + diagnosis)':<48} {total * 1e3:9.1f} ms")
    print(f"ratio full check / one forward+backward: {total / t_fb:.2f}x")


if __name__ == "__main__":
    main()
