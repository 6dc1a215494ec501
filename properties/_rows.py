"""Row-level properties: what the rows of absent and of repeated tokens must hold."""

from __future__ import annotations

import numpy as np

from tyingspec._cases import Case
from tyingspec._diagnosis import diagnose
from tyingspec._strategies import LEAVING_ROWS_ABSENT, REPEATING, cases

from ._common import Adapter, path_tolerance, rows_text
from ._core import PropertyFailure, discard, register
from ._gradients import observe


@register("absent_rows_are_output_path", "ROWS", ("model", "kernel"),
          lambda: cases(compositions=LEAVING_ROWS_ABSENT))
def absent_rows_are_output_path(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """Every row of a token absent from the batch equals the output path g.T @ h exactly (under
    the dtype's atol and rtol): the input path adds nothing to rows nobody looked up."""
    o = observe(fn, spec, kind, case)
    tol = path_tolerance(o.paths, o.dtype, o.scale)
    absent = np.ones(case.V, dtype=bool)
    absent[o.paths.tokens] = False
    if not absent.any():
        discard("every token of the vocabulary is in the batch")
    d_out = np.asarray(o.paths.dE_out, dtype=np.float64)
    if tol.close(np.zeros_like(d_out[absent]), d_out[absent]).all():
        discard("the output path is ~0 on every absent row (dropping it would pass)")
    ok = tol.close(np.asarray(o.dE, dtype=np.float64), d_out).all(axis=1)
    bad = np.flatnonzero(absent & ~ok)
    if bad.size:
        diag = diagnose(o.dE, o.paths, dtype=o.dtype, scale=o.scale)
        raise PropertyFailure(
            "absent_rows_are_output_path",
            f"{bad.size} of {int(absent.sum())} rows of absent tokens differ from the output path",
            o.concrete, diagnosis=diag, details=f"absent rows wrong: {rows_text(bad)}")


@register("repeated_tokens_accumulate", "DUP", ("model", "kernel"),
          lambda: cases(compositions=REPEATING))
def repeated_tokens_accumulate(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """The row of a token seen k times in the batch holds all k input-path contributions (plus
    its output path): no occurrence is lost, however many times the token repeats."""
    o = observe(fn, spec, kind, case)
    diag = diagnose(o.dE, o.paths, dtype=o.dtype, scale=o.scale)
    if not diag.repeated_rows:
        discard("no token repeats in this batch")
    if not diag.power.duplicates:
        discard("keeping one occurrence of each repeated token would pass here")
    rep = np.array(sorted(diag.repeated_rows), dtype=np.int64)
    ok = path_tolerance(o.paths, o.dtype, o.scale).close(
        np.asarray(o.dE, dtype=np.float64)[rep],
        np.asarray(o.paths.dE, dtype=np.float64)[rep]).all(axis=1)
    if not ok.all():
        bad = [int(r) for r in rep[~ok]]
        raise PropertyFailure(
            "repeated_tokens_accumulate",
            f"{len(bad)} of {rep.size} rows of repeated tokens lack some of their contributions",
            o.concrete, diagnosis=diag,
            details="wrong repeated rows (token x count): "
                    + ", ".join(f"{r} x{diag.repeated_rows[r]}" for r in bad[:16]))
