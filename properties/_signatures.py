"""Fingerprints of the mutant zoo: for each mutant, what exactly it gets wrong, as a check over
Hypothesis-drawn batches.

These are not user-facing properties (they are not in ``PROPERTIES``): they are tyingspec's own
power tests.  Each one says more than "the suite catches this mutant": it says *how* the mutant
shows, e.g. that dropping the input path leaves every absent row exact and every present row
wrong, or that a buffered scatter is wrong on exactly the rows of repeated tokens.

Most fingerprints have one form: the mutant's dE equals a stated combination of the reference's
two paths on every row; the rows the diagnosis calls wrong are exactly the rows where that
combination differs from the sum (borderline rows within 10x the tolerance excepted); and the
diagnosis reaches the mutant's ``expected`` label (with the right factors when it is
``path_scaled``), or, on an example too weak to tell them apart, another catalogue explanation
that fits the output just as well.  The stateful and hygiene mutants have their own checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tyingspec._cases import Batch, Case, build, closed_form, sgd_step
from tyingspec._diagnosis import Diagnosis, diagnose
from tyingspec._implementations import REGISTRY
from tyingspec._mutants import LOGIT_SCALE, reset_state
from tyingspec._probe import (
    Array,
    Paths,
    closed_form_paths,
    forward_parts,
    scatter_rows,
)
from tyingspec._strategies import LEAVING_ROWS_ABSENT, REPEATING, cases
from tyingspec._tolerance import Tolerance, tolerance_for

from ._common import (
    Adapter,
    concrete,
    dE_scale,
    judged_dtype,
    kernel_case,
    other_checks,
    path_tolerance,
    rows_text,
    run_model,
)
from ._core import discard, require_power
from ._gradients import observe

SignatureCheck = Callable[[Adapter, str, str, Case], None]


class SignatureMismatch(AssertionError):
    """A mutant did not show the fingerprint its zoo entry claims (message names the case)."""

    def __init__(self, mutant: str, problem: str, case: Case,
                 diagnosis: Diagnosis | None = None) -> None:
        self.mutant, self.case = mutant, case
        msg = f"mutant {mutant}: {problem}\nbatch: {case.describe()} " \
              f"tokens={list(case.tokens or ())} targets={list(case.targets or ())}"
        if diagnosis is not None:
            msg += f"\ndiagnosis: {diagnosis.headline()} wrong rows {diagnosis.wrong_rows[:16]}"
        super().__init__(msg)


@dataclass(frozen=True)
class Signature:
    """A mutant's fingerprint: the statement, the kinds it is checked for, examples, check."""

    mutant: str
    statement: str
    kinds: tuple[str, ...]
    strategy: Callable[[], st.SearchStrategy[Case]]
    check: SignatureCheck


SIGNATURES: dict[str, Signature] = {}


def _kinds(mutant: str) -> tuple[str, ...]:
    impl = REGISTRY[mutant]
    return tuple(k for k in ("model", "kernel") if impl.adapter(k) is not None)


def _scaled(tol: Tolerance, k: float) -> Tolerance:
    return Tolerance(atol=tol.atol * k, rtol=tol.rtol * k, dtype=tol.dtype)


# --- combinations of the two paths -------------------------------------------------------------

Candidate = Callable[[Batch, Paths], Array]
Labels = Callable[[Case, Batch, Paths], "set[str] | None"]  # None: any wrong label


def _present(paths: Paths, V: int) -> np.ndarray:
    p = np.zeros(V, dtype=bool)
    p[paths.tokens] = True
    return p


def _occurrence(paths: Paths, which: str) -> Array:
    t = paths.tokens
    if which == "first":
        keep = np.unique(t, return_index=True)[1]
    else:
        keep = t.shape[0] - 1 - np.unique(t[::-1], return_index=True)[1]
    rows = np.asarray(paths.per_position, dtype=np.float64)
    return scatter_rows(t[keep], rows[keep], paths.dE_in.shape[0])


def _without_token_zero(paths: Paths) -> Array:
    t = paths.tokens
    keep = t != 0
    rows = np.asarray(paths.per_position, dtype=np.float64)
    return scatter_rows(t[keep], rows[keep], paths.dE_in.shape[0])


def _output_from_x(batch: Batch, paths: Paths) -> Array:
    E = batch.E.astype(np.float64)
    p = forward_parts(E, E, batch.W.astype(np.float64),
                      None if batch.b is None else batch.b.astype(np.float64), batch.tokens,
                      batch.targets, batch.res, batch.s_in)
    return np.asarray(paths.dE_in) + p.g.T @ p.x


def _scaled_paths_fit(actual: Array, paths: Paths, tol: Tolerance) -> bool:
    """Whether ``actual`` is a*dE_in + c*dE_out for some a, c (small batches can make any
    wrong output path look like a scaled one: then path_scaled is the right diagnosis)."""
    d_in, d_out = np.asarray(paths.dE_in, np.float64), np.asarray(paths.dE_out, np.float64)
    A = np.stack([d_in.reshape(-1), d_out.reshape(-1)], axis=1)
    coef, *_ = np.linalg.lstsq(A, actual.reshape(-1), rcond=None)
    return bool(tol.close(actual, coef[0] * d_in + coef[1] * d_out).all())


def _fitting_labels(actual: Array, paths: Paths, tol: Tolerance) -> set[str]:
    """Catalogue explanations that fit ``actual`` within ``tol``.  On a weak example two can
    fit at once (e.g. dE_in ~ dE_out on the one present row: overwritten and input-missing look
    alike); the diagnosis names the first it tries, and that is not a wrong diagnosis."""
    d_in, d_out = np.asarray(paths.dE_in, np.float64), np.asarray(paths.dE_out, np.float64)
    present = _present(paths, d_in.shape[0])[:, None]
    candidates = {"input_path_missing": [d_out], "output_path_missing": [d_in],
                  "output_path_overwritten": [np.where(present, d_in, d_out)],
                  "duplicates_not_accumulated": [_occurrence(paths, w) + d_out
                                                 for w in ("first", "last")]}
    fit = {label for label, cands in candidates.items()
           if any(tol.close(actual, c).all() for c in cands)}
    return fit | ({"path_scaled"} if _scaled_paths_fit(actual, paths, tol) else set())


def _fixed(*labels: str) -> Labels:
    return lambda case, batch, paths: set(labels)


def _all_present_allows(label: str, *also: str) -> Labels:
    """``label``, or ``also`` when every row is present (the row pattern cannot say more)."""
    def labels(case: Case, batch: Batch, paths: Paths) -> set[str]:
        return {label} | (set(also) if _present(paths, case.V).all() else set())
    return labels


def _combination(mutant: str, statement: str, candidate: Candidate, labels: Labels, *,
                 scales: Callable[[Case], tuple[float, float]] | None = None,
                 strategy: Callable[[], st.SearchStrategy[Case]] = lambda: cases()) -> None:
    def check(fn: Adapter, spec: str, kind: str, case: Case) -> None:
        dE, paths, conc, batch, dtype, scale = observe(fn, spec, kind, case)
        diag = diagnose(dE, paths, dtype=dtype, scale=scale)
        require_power(diag)
        cand = candidate(batch, paths)
        tol = path_tolerance(paths, dtype, scale)
        actual = np.asarray(dE, dtype=np.float64)
        off = ~tol.close(actual, cand).all(axis=1)
        if off.any():
            raise SignatureMismatch(mutant, f"dE is not {statement} on rows "
                                    f"{rows_text(np.flatnonzero(off))}", conc, diag)
        ref = np.asarray(paths.dE, dtype=np.float64)
        surely_wrong = ~_scaled(tol, 10.0).close(cand, ref).all(axis=1)
        surely_right = _scaled(tol, 0.1).close(cand, ref).all(axis=1)
        wrong = np.zeros(case.V, dtype=bool)
        wrong[diag.wrong_rows] = True
        if (surely_wrong & ~wrong).any() or (surely_right & wrong).any():
            raise SignatureMismatch(
                mutant, f"wrong rows {diag.wrong_rows} are not where {statement} differs from "
                f"the sum ({rows_text(np.flatnonzero(surely_wrong))})", conc, diag)
        if not wrong.any():
            if diag.label != "correct":
                raise SignatureMismatch(mutant, f"no row differs, yet {diag.label}", conc, diag)
            return
        allowed = labels(case, batch, paths)
        if allowed is not None and diag.label not in allowed | _fitting_labels(actual, paths,
                                                                                tol):
            raise SignatureMismatch(mutant, f"diagnosis {diag.label}, expected one of "
                                    f"{sorted(allowed)}", conc, diag)
        if scales is not None and diag.label == "path_scaled":
            want = scales(case)
            if diag.scales is None or not np.allclose(diag.scales, want, rtol=1e-3, atol=1e-6):
                raise SignatureMismatch(mutant, f"fitted scales {diag.scales}, expected {want}",
                                        conc, diag)

    SIGNATURES[mutant] = Signature(mutant, f"dE = {statement}", _kinds(mutant), strategy, check)


_combination("output-path-only", "dE_out (absent rows exact, present rows wrong)",
             lambda b, p: np.asarray(p.dE_out), _fixed("input_path_missing"))
_combination("input-path-only", "dE_in (every row with an output path wrong)",
             lambda b, p: np.asarray(p.dE_in), _fixed("output_path_missing"))
_combination("output-path-overwritten",
             "dE_in on rows of batch tokens, dE_out elsewhere (absent rows exact)",
             lambda b, p: np.where(_present(p, b.E.shape[0])[:, None], p.dE_in, p.dE_out),
             _all_present_allows("output_path_overwritten", "output_path_missing"))
_combination("paths-averaged", "(dE_in + dE_out) / 2", lambda b, p: (p.dE_in + p.dE_out) / 2,
             _fixed("path_scaled"), scales=lambda c: (0.5, 0.5))
_combination("input-path-doubled", "2 dE_in + dE_out", lambda b, p: 2 * p.dE_in + p.dE_out,
             _fixed("path_scaled"), scales=lambda c: (2.0, 1.0))
_combination("logit-scale-dropped", f"dE_in + dE_out / {LOGIT_SCALE}",
             lambda b, p: p.dE_in + p.dE_out / LOGIT_SCALE, _fixed("path_scaled"),
             scales=lambda c: (1.0, 1 / LOGIT_SCALE))
_combination("input-path-sum-not-mean", "N dE_in + dE_out",
             lambda b, p: p.tokens.shape[0] * p.dE_in + p.dE_out, _fixed("path_scaled"),
             scales=lambda c: (float(c.N), 1.0))
_combination("s-in-missing-in-backward", "dE_in / s_in + dE_out (right when s_in = 1)",
             lambda b, p: p.dE_in / b.s_in + p.dE_out, _fixed("path_scaled"),
             scales=lambda c: (1 / c.s_in, 1.0))
for _name, _which in (("duplicates-buffered", "last"), ("duplicates-last-only", "last"),
                      ("duplicates-first-only", "first")):
    _combination(_name, f"the {_which} occurrence of each token + dE_out (only rows of "
                        "repeated tokens wrong)",
                 lambda b, p, w=_which: _occurrence(p, w) + p.dE_out,  # type: ignore[misc]
                 _fixed("duplicates_not_accumulated"), strategy=lambda: cases(
                     compositions=REPEATING))
_combination("padding-row-masked",
             "dE_in without the positions of token 0 + dE_out (only row 0 wrong)",
             lambda b, p: _without_token_zero(p) + p.dE_out,
             # all positions token 0: the whole input path is missing; else only row 0 is
             lambda c, b, p: {"input_path_missing" if (p.tokens == 0).all()
                              else "input_path_wrong"},
             strategy=lambda: cases(compositions=("with-zero", "one-token", "random")))
def _wrong_output_path(case: Case, paths: Paths, actual: Array,
                       scale: float) -> set[str] | None:
    """Labels for a wrong output path: output_path_wrong once some absent row is surely wrong
    (path_scaled too when the wrong head gradient happens to be a multiple of g.T @ h, e.g.
    d = 1 and one distinct token).  None (any wrong label) when no absent row is surely wrong:
    then the row pattern cannot tell which path is at fault."""
    tol = path_tolerance(paths, case.dtype, scale)
    absent = ~_present(paths, case.V)
    surely = ~_scaled(tol, 10.0).close(actual, np.asarray(paths.dE, np.float64)).all(axis=1)
    if not (surely & absent).any():
        return None
    return {"output_path_wrong"} | ({"path_scaled"} if _scaled_paths_fit(actual, paths, tol)
                                    else set())


_combination("output-path-from-x", "dE_in + g.T @ x (absent rows wrong)", _output_from_x,
             lambda c, b, p: _wrong_output_path(c, p, _output_from_x(b, p), dE_scale(b)),
             strategy=lambda: cases(compositions=LEAVING_ROWS_ABSENT))


# --- the others ----------------------------------------------------------------------------

def _register(mutant: str, strategy: Callable[[], st.SearchStrategy[Case]] = lambda: cases()
              ) -> Callable[[SignatureCheck], SignatureCheck]:
    def deco(check: SignatureCheck) -> SignatureCheck:
        SIGNATURES[mutant] = Signature(mutant, (check.__doc__ or "").strip(), _kinds(mutant),
                                       strategy, check)
        return check
    return deco


@_register("grad-not-zeroed")
def _grad_not_zeroed(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """After a reset the first call is exactly right and the second identical call returns
    twice the gradient: diagnosed path_scaled with both paths doubled."""
    reset_state()
    first, paths, conc, _, dtype, scale = observe(fn, spec, kind, case)
    second = observe(fn, spec, kind, case).dE
    d1 = diagnose(first, paths, dtype=dtype, scale=scale)
    require_power(d1)
    d2 = diagnose(second, paths, dtype=dtype, scale=scale)
    if d1.label != "correct":
        raise SignatureMismatch("grad-not-zeroed", "first call after a reset is wrong", conc, d1)
    if not path_tolerance(paths, dtype, 2 * scale).close(
            np.asarray(second, np.float64), 2 * np.asarray(paths.dE, np.float64)).all():
        raise SignatureMismatch("grad-not-zeroed", "second call is not 2 dE", conc, d2)
    if d2.label != "path_scaled" or d2.scales is None or \
            not np.allclose(d2.scales, (2.0, 2.0), rtol=1e-3, atol=1e-6):
        raise SignatureMismatch("grad-not-zeroed", "second call not path_scaled x2, x2", conc, d2)


@_register("copy-tie")
def _copy_tie(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """The first call is exactly right (U = E); after one SGD step of E along the returned dE,
    the gradient is that of an *untied* model whose head U took the same step with the output
    path only: dE(E1) = dE_in(E1, U1) + dE_out(E1, U1) with U1 = E0 - lr dE_out(E0).  Once a
    row of an absent token is surely wrong the diagnosis is output_path_wrong."""
    reset_state()
    batch = build(case)
    paths0 = closed_form(batch)
    first = run_model(spec, fn, batch)
    conc = concrete(case, batch)
    dtype = judged_dtype(case, first.dE)
    d0 = diagnose(first.dE, paths0, dtype=dtype, scale=dE_scale(batch))
    require_power(d0)
    if d0.label != "correct":
        raise SignatureMismatch("copy-tie", "first call is wrong", conc, d0)
    step = sgd_step(batch, first.dE)
    if step is None:
        discard("the returned gradient is zero: the step would not move E")
    stepped, lr = step
    second = run_model(spec, fn, stepped)
    tied1 = closed_form(stepped)
    scale1 = dE_scale(stepped)
    d1 = diagnose(second.dE, tied1, dtype=dtype, scale=scale1)
    U1 = (batch.E.astype(np.float64) - lr * np.asarray(paths0.dE_out)).astype(
        batch.E.dtype).astype(np.float64)
    W, b = batch.W.astype(np.float64), None if batch.b is None else batch.b.astype(np.float64)
    untied = closed_form_paths(stepped.E.astype(np.float64), W, b, batch.tokens, batch.targets,
                               batch.res, batch.s_in, E_out=U1)
    if not path_tolerance(untied, dtype, scale1).close(np.asarray(second.dE, np.float64),
                                                       untied.dE).all():
        raise SignatureMismatch("copy-tie", "after the step dE is not the untied gradient at "
                                "(E1, U1)", conc, d1)
    allowed = _wrong_output_path(case, tied1, np.asarray(second.dE, np.float64), scale1)
    if d1.wrong and allowed is not None and d1.label not in allowed:
        raise SignatureMismatch("copy-tie", f"after the step: {d1.label}, expected "
                                f"{sorted(allowed)}", conc, d1)


@_register("sorts-tokens-in-place")
def _sorts(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """The gradient is right and exactly ``tokens`` is written into, whenever the batch is not
    already sorted: diagnosed inputs_mutated."""
    batch = build(case)
    paths = closed_form(batch)
    if kind == "kernel":
        k, _, paths = kernel_case(batch)
        dE, mutated = k.call(spec, fn)
    else:
        out = run_model(spec, fn, batch)
        dE, mutated = out.dE, out.mutated
    diag = diagnose(dE, paths, dtype=judged_dtype(case, dE), mutated=mutated,
                    scale=dE_scale(batch))
    require_power(diag)
    want = () if (np.diff(batch.tokens) >= 0).all() else ("tokens",)
    conc = concrete(case, batch)
    if tuple(mutated) != want:
        raise SignatureMismatch("sorts-tokens-in-place", f"mutated {mutated}, expected {want}",
                                conc, diag)
    if diag.label != ("inputs_mutated" if want else "correct"):
        raise SignatureMismatch("sorts-tokens-in-place", f"diagnosis {diag.label}", conc, diag)


@_register("db-sum-not-mean")
def _db_sum(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """dE, dW and the loss are right; db is N times the reference (diagnosed
    other_gradient_wrong whenever N > 1 and b is present)."""
    batch = build(case)
    paths = closed_form(batch)
    out = run_model(spec, fn, batch)
    dtype = judged_dtype(case, out.dE)
    checks = other_checks(out, paths, dtype, batch)
    diag = diagnose(out.dE, paths, dtype=dtype, others=checks, scale=dE_scale(batch))
    require_power(diag)
    conc = concrete(case, batch)
    bad = {c.name for c in checks if not c.ok}
    if "loss" in bad or "dW" in bad:
        raise SignatureMismatch("db-sum-not-mean", f"wrong {sorted(bad)}", conc, diag)
    if paths.db is not None:
        want = case.N * np.asarray(paths.db)
        if not tolerance_for(dtype, want).close(np.asarray(out.db, np.float64), want).all():
            raise SignatureMismatch("db-sum-not-mean", "db is not N * db_ref", conc, diag)
    expect = "other_gradient_wrong" if bad else "correct"
    if diag.label != expect:
        raise SignatureMismatch("db-sum-not-mean", f"diagnosis {diag.label}, expected {expect}",
                                conc, diag)


def missing_signatures() -> list[str]:
    """Mutants in the registry without a fingerprint here (should be empty)."""
    return [impl.name for impl in REGISTRY.values() if not impl.correct
            and impl.name not in SIGNATURES]


def describe() -> dict[str, Any]:
    """Mutant -> its fingerprint statement (for reports)."""
    return {name: s.statement for name, s in SIGNATURES.items()}
