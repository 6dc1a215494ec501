"""Kernel-only properties: the combining kernel is linear in the gradients it combines."""

from __future__ import annotations

import numpy as np

from tyingspec._cases import Case, build
from tyingspec._diagnosis import diagnose
from tyingspec._strategies import cases

from ._common import (
    Adapter,
    agree,
    concrete,
    dE_scale,
    judged_dtype,
    kernel_case,
    seeded,
)
from ._core import PropertyFailure, register


def _coefficient(case: Case, salt: int) -> float:
    # |a| in [0.5, 2]: far from 0 (which would hide the first term) and from 1 for power
    rng = seeded(case, salt)
    return float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 2.0))


def _linearity(fn: Adapter, spec: str, case: Case, name: str, which: str, salt: int) -> None:
    batch = build(case)
    k, _, paths = kernel_case(batch)
    base = getattr(k, which)
    rng = seeded(case, salt)
    a = _coefficient(case, salt + 1)
    scale = float(np.max(np.abs(base))) if base.size else 1.0
    other = (rng.normal(size=base.shape) * (scale or 1.0)).astype(base.dtype)
    zero = np.zeros_like(base)
    mix = (base.dtype.type(a) * base + other).astype(base.dtype)
    f_mix, _ = k.call(spec, fn, **{which: mix})
    f_zero, _ = k.call(spec, fn, **{which: zero})
    f_one, _ = k.call(spec, fn, **{which: base})
    f_other, _ = k.call(spec, fn, **{which: other})
    dtype = judged_dtype(case, f_mix, f_one)
    lhs = np.asarray(f_mix, np.float64) + a * np.asarray(f_zero, np.float64)
    rhs = a * np.asarray(f_one, np.float64) + np.asarray(f_other, np.float64)
    ok = agree(lhs, rhs, dtype, f_mix, f_zero, f_one, f_other).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        raise PropertyFailure(
            name, f"f({which} = a*{which}1 + {which}2) + a*f(0) != a*f({which}1) + f({which}2) "
                  f"on {bad.size} of {case.V} rows (a = {a:.6g})", concrete(case, batch),
            diagnosis=diagnose(f_one, paths, dtype=dtype, scale=dE_scale(batch)),
            details=f"rows that break linearity: {[int(r) for r in bad[:16]]}; "
                    f"{which}2 drawn from the case seed")


@register("linear_in_dx", "LIN", ("kernel",), lambda: cases())
def linear_in_dx(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """With tokens, h and g held, the kernel is linear in dx once its dx-free part is taken
    out: f(a*dx1 + dx2) - f(0) = a*(f(dx1) - f(0)) + (f(dx2) - f(0)) for any a, dx1, dx2 (the
    input path is a scatter-add, linear in what it scatters)."""
    _linearity(fn, spec, case, "linear_in_dx", "dx", 0xD1)


@register("linear_in_g", "LIN", ("kernel",), lambda: cases())
def linear_in_g(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """With tokens, dx and h held, the kernel is linear in g once its g-free part is taken out:
    f(a*g1 + g2) - f(0) = a*(f(g1) - f(0)) + (f(g2) - f(0)) for any a, g1, g2 (the output path
    g.T @ h is linear in g)."""
    _linearity(fn, spec, case, "linear_in_g", "g", 0x61)
