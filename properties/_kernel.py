"""Kernel-only properties: the combining kernel is linear in the gradients it combines."""

from __future__ import annotations

import numpy as np

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import (
    Target,
    agree,
    batch_for,
    call,
    judge,
    precision_for,
    reference,
)

from ._common import rows_text, seeded
from ._core import PropertyFailure, register


def _coefficient(case: Case, salt: int) -> float:
    # |a| in [0.5, 2]: far from 0 (which would hide the first term) and from 1 for power
    rng = seeded(case, salt)
    return float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 2.0))


def _linearity(target: Target, case: Case, name: str, which: str, salt: int) -> None:
    case, batch = batch_for(target, case)
    inputs = target.kind.inputs(batch)
    base = inputs[which]
    rng = seeded(case, salt)
    a = _coefficient(case, salt + 1)
    scale = float(np.max(np.abs(base))) if base.size else 1.0
    other = (rng.normal(size=base.shape) * (scale or 1.0)).astype(base.dtype)
    zero = np.zeros_like(base)
    mix = (base.dtype.type(a) * base + other).astype(base.dtype)
    f_mix, f_zero, f_one, f_other = (call(target, batch, **{which: v})
                                     for v in (mix, zero, base, other))
    precision = precision_for(target, f_mix, f_one)
    lhs = np.asarray(f_mix.dE, np.float64) + a * np.asarray(f_zero.dE, np.float64)
    rhs = a * np.asarray(f_one.dE, np.float64) + np.asarray(f_other.dE, np.float64)
    # four calls, each within its own bound: judge the combination on the sum of their bounds
    refs = [reference(target, batch, **{which: v}) for v in (mix, other)]
    ok = np.ones(case.V, dtype=bool)
    for ref in refs:
        ok &= agree("dE", lhs, rhs, ref, precision, factor=2.0 + 2.0 * abs(a)).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        raise PropertyFailure(
            name, f"f({which} = a*{which}1 + {which}2) + a*f(0) != a*f({which}1) + f({which}2) "
                  f"on {bad.size} of {case.V} rows (a = {a:.6g})",
            case,
            diagnosis=judge(f_one, reference(target, batch), precision),
            details=f"rows that break linearity: {rows_text(bad)}; {which}2 drawn from the "
                    "case seed")


@register("linear_in_dx", "LIN", lambda: cases())
def linear_in_dx(target: Target, case: Case) -> None:
    """With tokens, h and g held, the kernel is linear in dx once its dx-free part is taken
    out: f(a*dx1 + dx2) - f(0) = a*(f(dx1) - f(0)) + (f(dx2) - f(0)) for any a, dx1, dx2 (the
    input path is a scatter-add, linear in what it scatters)."""
    _linearity(target, case, "linear_in_dx", "dx", 0xD1)


@register("linear_in_g", "LIN", lambda: cases())
def linear_in_g(target: Target, case: Case) -> None:
    """With tokens, dx and h held, the kernel is linear in g once its g-free part is taken out:
    f(a*g1 + g2) - f(0) = a*(f(g1) - f(0)) + (f(g2) - f(0)) for any a, g1, g2 (the output path
    g.T @ h is linear in g)."""
    _linearity(target, case, "linear_in_g", "g", 0x61)
