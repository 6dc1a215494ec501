"""Properties of the tied gradient itself, checked against the two-path reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tyingspec._cases import Batch, Case, build, closed_form, kernel_inputs
from tyingspec._diagnosis import diagnose
from tyingspec._probe import Paths
from tyingspec._strategies import cases
from tyingspec._symbolic import symbolic_paths

from ._common import dE_scale, judged_dtype, run_model
from ._core import PropertyFailure, register, require_power

#: Shapes up to this many entries of E use the sympy reference.  The derivation compiles in
#: under 0.35 s for each such (V, d, bias) (about 4 s for all of them, once per process); the
#: full symbolic range (V*d <= 12) costs ~36 s per process, too much for a property run.
SYMBOLIC_ENTRIES = 6


def reference(b: Batch) -> Paths:
    """sympy-derived paths on small shapes, the closed form beyond them (always float64)."""
    if b.E.size > SYMBOLIC_ENTRIES:
        return closed_form(b)
    return symbolic_paths(b.E.astype("float64"), b.W.astype("float64"),
                          None if b.b is None else b.b.astype("float64"), b.tokens, b.targets,
                          b.res, b.s_in)


class Observation(NamedTuple):
    """An adapter's dE on a case, the reference paths, the concrete case and its arrays."""

    dE: Any
    paths: Paths
    concrete: Case
    batch: Batch
    dtype: str  # what the comparison is judged at
    scale: float  # natural size of dE (atol anchor), see _common.natural_scales


def observe(fn: Callable[..., Any], spec: str, kind: str, case: Case) -> Observation:
    """Run the adapter on a case and gather everything a dE property compares."""
    b = build(case)
    concrete = case.with_batch(b.tokens, b.targets)
    if kind == "kernel":
        parts, paths = kernel_inputs(b)
        from tyingspec._adapters import call_kernel

        dE, _ = call_kernel(spec, fn, b.tokens, parts.input_rows, parts.h, parts.g, case.V)
    else:
        dE, paths = run_model(spec, fn, b).dE, reference(b)
    return Observation(dE, paths, concrete, b, judged_dtype(case, dE), dE_scale(b))


def dE_of(fn: Callable[..., Any], spec: str, kind: str, case: Case) -> tuple[Any, Paths, Case]:
    """Run the adapter on a case; returns its dE, the reference paths and the concrete batch."""
    o = observe(fn, spec, kind, case)
    return o.dE, o.paths, o.concrete


@register("sum_of_paths", "SUM", ("model", "kernel"), lambda: cases())
def sum_of_paths(fn: Callable[..., Any], spec: str, kind: str, case: Case) -> None:
    """The tied gradient equals input path + output path on every row (sympy reference on small
    shapes, closed form on larger ones)."""
    o = observe(fn, spec, kind, case)
    diag = diagnose(o.dE, o.paths, dtype=o.dtype, scale=o.scale)
    require_power(diag)
    if diag.wrong:
        raise PropertyFailure("sum_of_paths", "dE != dE_in + dE_out", o.concrete, diagnosis=diag)
