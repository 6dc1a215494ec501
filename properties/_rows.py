"""Row-level properties: what the rows of absent and of repeated tokens must hold."""

from __future__ import annotations

import numpy as np

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import LEAVING_ROWS_ABSENT, REPEATING, cases
from tyingspec._src.engine.observe import Target, first_call, row_bound

from ._common import rows_text
from ._core import PropertyFailure, discard, register


@register("absent_rows_are_output_path", "ROWS", lambda: cases(compositions=LEAVING_ROWS_ABSENT))
def absent_rows_are_output_path(target: Target, case: Case) -> None:
    """Every row of a token absent from the batch equals the output path g.T @ h within its
    rounding bound: the input path adds nothing to rows nobody looked up."""
    o = first_call(target, case)
    tol = row_bound(o.paths, o.precision)
    absent = np.ones(o.case.V, dtype=bool)
    absent[o.paths.tokens] = False
    if not absent.any():
        discard("every token of the vocabulary is in the batch")
    d_out = np.asarray(o.paths.dE_out, dtype=np.float64)
    if tol.rows(absent).close(np.zeros_like(d_out[absent]), d_out[absent]).all():
        discard("the output path is within rounding of 0 on every absent row")
    ok = tol.close(np.asarray(o.returned.dE, dtype=np.float64), d_out).all(axis=1)
    bad = np.flatnonzero(absent & ~ok)
    if bad.size:
        raise PropertyFailure(
            "absent_rows_are_output_path",
            f"{bad.size} of {int(absent.sum())} rows of absent tokens differ from the output path",
            o.case, diagnosis=o.diagnosis, details=f"absent rows wrong: {rows_text(bad)}")


@register("repeated_tokens_accumulate", "DUP", lambda: cases(compositions=REPEATING))
def repeated_tokens_accumulate(target: Target, case: Case) -> None:
    """The row of a token seen k times in the batch holds all k input-path contributions (plus
    its output path): no occurrence is lost, however many times the token repeats."""
    o = first_call(target, case)
    diag = o.diagnosis
    if not diag.repeated_rows:
        discard("no token repeats in this batch")
    if not diag.power.duplicates:
        discard("keeping one occurrence of each repeated token would pass here")
    rep = np.array(sorted(diag.repeated_rows), dtype=np.int64)
    ok = row_bound(o.paths, o.precision).rows(rep).close(
        np.asarray(o.returned.dE, dtype=np.float64)[rep],
        np.asarray(o.paths.dE, dtype=np.float64)[rep]).all(axis=1)
    if not ok.all():
        bad = [int(r) for r in rep[~ok]]
        raise PropertyFailure(
            "repeated_tokens_accumulate",
            f"{len(bad)} of {rep.size} rows of repeated tokens lack some of their contributions",
            o.case, diagnosis=diag,
            details="wrong repeated rows (token x count): "
                    + ", ".join(f"{r} x{diag.repeated_rows[r]}" for r in bad[:16]))
