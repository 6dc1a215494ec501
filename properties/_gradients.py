"""Properties of the tied gradient itself, checked against the two-path reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tyingspec._adapters import call_kernel, call_model
from tyingspec._cases import Case, build, kernel_inputs
from tyingspec._diagnosis import diagnose
from tyingspec._probe import Paths, closed_form_paths
from tyingspec._strategies import cases
from tyingspec._symbolic import MAX_SYMBOLIC_ENTRIES, symbolic_paths

from ._core import PropertyFailure, register, require_power


def reference(case: Case) -> Paths:
    """sympy-derived paths on small shapes, the closed form beyond them."""
    b = build(case)
    f = symbolic_paths if case.V * case.d <= MAX_SYMBOLIC_ENTRIES else closed_form_paths
    return f(b.E.astype("float64"), b.W.astype("float64"),
             None if b.b is None else b.b.astype("float64"), b.tokens, b.targets, b.res, b.s_in)


def dE_of(fn: Callable[..., Any], spec: str, kind: str, case: Case) -> tuple[Any, Paths, Case]:
    """Run the adapter on a case; returns its dE, the reference paths and the concrete batch."""
    b = build(case)
    concrete = case.with_batch(b.tokens, b.targets)
    if kind == "kernel":
        parts, paths = kernel_inputs(b)
        dE, _ = call_kernel(spec, fn, b.tokens, parts.input_rows, parts.h, parts.g, case.V)
        return dE, paths, concrete
    out = call_model(spec, fn, b.E, b.W, b.b, b.tokens, b.targets, res=b.res, s_in=b.s_in)
    return out.dE, reference(case), concrete


@register("sum_of_paths", "SUM", ("model", "kernel"), lambda: cases())
def sum_of_paths(fn: Callable[..., Any], spec: str, kind: str, case: Case) -> None:
    """The tied gradient equals input path + output path on every row (sympy reference on small
    shapes, closed form on larger ones)."""
    dE, paths, concrete = dE_of(fn, spec, kind, case)
    diag = diagnose(dE, paths, dtype=case.dtype)
    require_power(diag)
    if diag.wrong:
        raise PropertyFailure("sum_of_paths", "dE != dE_in + dE_out", concrete, diagnosis=diag)
