"""Fingerprints of the mutant zoo: for each mutant, what exactly it gets wrong, as a check over
Hypothesis-drawn batches.

These are not user-facing properties (they are not in ``PROPERTIES``): they are tyingspec's own
power tests.  Each one says more than "the suite catches this mutant": it says *how* the mutant
shows, e.g. that dropping the input path leaves every absent row exact and every present row
wrong, or that a buffered scatter is wrong on exactly the rows of repeated tokens.

Every call, reference, precision and bound comes from :mod:`engine.observe`, so a fingerprint
checks the verdict ``tyingspec check`` and the properties reach, not a verdict of its own.

Most fingerprints have one form: the mutant's dE equals a stated combination of the reference's
two paths on every row (within each row's rounding bound); the rows the diagnosis calls wrong are
exactly the rows where that combination differs from the sum (borderline rows within 10x the
bound excepted); and the diagnosis reaches the mutant's ``expected`` label (with the right
factors when it is ``path_scaled``), or, on an example too weak to tell them apart, another
catalogue explanation that fits the output just as well.  The stateful and hygiene mutants have
their own checks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from hypothesis import strategies as st

from tyingspec._src.core.cases import Batch, Case, sgd_step
from tyingspec._src.core.diagnosis import Diagnosis, diagnose, misrouted_input_fits
from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.paths import Array, Paths, closed_form_paths, forward_parts, scatter_rows
from tyingspec._src.core.render import batch_lines, diagnosis_lines
from tyingspec._src.core.strategies import LEAVING_ROWS_ABSENT, REPEATING, cases
from tyingspec._src.core.tolerance import LOWER, Precision, Tolerance, amplification
from tyingspec._src.engine.observe import (
    AFTER_STEP,
    FIRST_CALL,
    SECOND_CALL_POSITIONS,
    Observation,
    Stage,
    Target,
    agree,
    call,
    first_call,
    judge,
    observe,
    precision_for,
    reference,
    row_bound,
)
from tyingspec._src.kinds.probe.builtins import builtins
from tyingspec._src.kinds.probe.mutants import LOGIT_SCALE, reset_state
from tyingspec._src.kinds.table import KIND_NAMES, Kind

from ._common import rows_text
from ._core import discard, require_power

#: A fingerprint: raises SignatureMismatch when the mutant behind ``target`` does not show it on
#: ``case``; discards (``hypothesis.assume``) an example that cannot show it.
SignatureCheck = Callable[[Target, Case], None]


class SignatureMismatch(TyingspecError, AssertionError):
    """A mutant did not show the fingerprint its zoo entry claims (message names the case)."""

    def __init__(self, mutant: str, problem: str, case: Case,
                 diagnosis: Diagnosis | None = None, stage: Stage = FIRST_CALL) -> None:
        self.mutant, self.problem, self.case = mutant, problem, case
        self.diagnosis, self.stage = diagnosis, stage
        lines = [f"mutant {mutant}: {problem}"]
        if diagnosis is not None:
            lines += diagnosis_lines(diagnosis, stage=stage, indent="")
        super().__init__("\n".join([*lines, "batch:", *batch_lines(case)]))


@dataclass(frozen=True)
class Signature:
    """A mutant's fingerprint: the statement, the kinds it is checked for, examples, check."""

    mutant: str
    statement: str
    kinds: tuple[Kind, ...]
    strategy: Callable[[], st.SearchStrategy[Case]]
    check: SignatureCheck


SIGNATURES: dict[str, Signature] = {}


def _kinds(mutant: str) -> tuple[Kind, ...]:
    impl = builtins()[mutant]
    return tuple(k for k in KIND_NAMES if impl.adapter(k) is not None)


def _scaled(tol: Tolerance, k: float) -> Tolerance:
    return Tolerance(atol=tol.atol * k, rtol=tol.rtol * k, dtype=tol.dtype)


def _widened(a: Tolerance, b: Tolerance) -> Tolerance:
    """Both allowances at once: ``x`` within ``a`` of ``y`` and ``y`` within ``b`` of ``z`` puts
    ``x`` within this of ``z`` (up to a second-order rtol term)."""
    return Tolerance(atol=np.asarray(a.atol) + np.asarray(b.atol), rtol=a.rtol + b.rtol,
                     dtype=a.dtype)


def _f64(a: object) -> Array:
    out: Array = np.asarray(a, dtype=np.float64)
    return out


# --- combinations of the two paths -------------------------------------------------------------

Candidate = Callable[[Batch, Paths], Array]
#: The labels a diagnosis may reach on an observation; None: any wrong label.
Labels = Callable[[Observation], "set[str] | None"]


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
    rows = _f64(paths.per_position)
    return scatter_rows(t[keep], rows[keep], paths.dE_in.shape[0])


def _without_token_zero(paths: Paths) -> Array:
    t = paths.tokens
    keep = t != 0
    rows = _f64(paths.per_position)
    return scatter_rows(t[keep], rows[keep], paths.dE_in.shape[0])


def _output_from_x(batch: Batch, paths: Paths) -> Array:
    E = batch.E.astype(np.float64)
    p = forward_parts(E, E, batch.W.astype(np.float64),
                      None if batch.b is None else batch.b.astype(np.float64), batch.tokens,
                      batch.targets, batch.res, batch.s_in)
    return _f64(paths.dE_in) + p.g.T @ p.x


def _scaled_paths_fit(actual: Array, paths: Paths, tol: Tolerance,
                      claimed: tuple[float, float] | None = None) -> bool:
    """Whether ``actual`` is a*dE_in + c*dE_out for some a, c (small batches can make any
    wrong output path look like a scaled one: then path_scaled is the right diagnosis): the
    least-squares pair, or the pair the diagnosis ``claimed``, within the bound, a path taken k
    times allowed k times its rounding.  Least squares weighs every entry alike, so on a row
    whose bound is tight it can miss a pair (one factor exactly 1, the other rounded) that
    fits every row; the claimed pair is checked here, not trusted."""
    d_in, d_out = _f64(paths.dE_in), _f64(paths.dE_out)
    A = np.stack([d_in.reshape(-1), d_out.reshape(-1)], axis=1)
    coef, *_ = np.linalg.lstsq(A, actual.reshape(-1), rcond=None)
    pairs = [(float(coef[0]), float(coef[1]))] + ([claimed] if claimed is not None else [])
    return any(bool(tol.amplified(amplification(a, c)).close(actual, a * d_in + c * d_out)
                    .all()) for a, c in pairs)


#: Occurrences of one token up to which every subset of them is tried (2^12 sums).
_SUBSETS_UP_TO = 12


def _lost_occurrences_fit(actual: Array, paths: Paths, tol: Tolerance) -> bool:
    """Whether every wrong row is a repeated token's and holds, with its output path, a proper
    non-empty subset of that token's occurrences within its bound: a scatter that lost some of
    them.  With few entries per row, the occurrences of one token are nearly parallel (the same
    x, only g differs), so a stray factor on the input path can look like two of four of them,
    and the diagnosis may name either."""
    d_in, d_out = _f64(paths.dE_in), _f64(paths.dE_out)
    wrong = np.flatnonzero(~tol.close(actual, d_in + d_out).all(axis=1))
    rows = _f64(paths.per_position)

    def holds_some(r: int) -> bool:
        where = np.flatnonzero(paths.tokens == r)
        if not 2 <= where.shape[0] <= _SUBSETS_UP_TO:
            return False
        bound = tol.rows(np.array([r]))
        return any(bool(bound.close(actual[r:r + 1], rows[list(sub)].sum(axis=0, keepdims=True)
                                    + d_out[r:r + 1]).all())
                   for size in range(1, where.shape[0])
                   for sub in itertools.combinations(where, size))

    return bool(wrong.shape[0]) and all(holds_some(int(r)) for r in wrong)


def _fitting_labels(actual: Array, paths: Paths, tol: Tolerance,
                    claimed: tuple[float, float] | None = None) -> set[str]:
    """Catalogue explanations that fit ``actual`` within ``tol``.  On a weak example two can
    fit at once (e.g. dE_in ~ dE_out on the one present row: overwritten and input-missing look
    alike); the diagnosis names the first it tries, and that is not a wrong diagnosis.
    ``claimed``: the path factors the diagnosis fitted, checked by :func:`_scaled_paths_fit`."""
    d_in, d_out = _f64(paths.dE_in), _f64(paths.dE_out)
    present = _present(paths, d_in.shape[0])[:, None]
    candidates = {"input_path_missing": [d_out], "output_path_missing": [d_in],
                  "output_path_overwritten": [np.where(present, d_in, d_out)],
                  "duplicates_not_accumulated": [_occurrence(paths, w) + d_out
                                                 for w in ("first", "last")]}
    fit = {label for label, cands in candidates.items()
           if any(tol.close(actual, c).all() for c in cands)}
    if _lost_occurrences_fit(actual, paths, tol):
        fit.add("duplicates_not_accumulated")
    return fit | ({"path_scaled"} if _scaled_paths_fit(actual, paths, tol, claimed) else set())


def _seeing_lower(o: Observation) -> Precision | None:
    """The next lower precision when it still sees both paths on this example, else None.

    ``precision_limited`` ("within the lower precision's bound") is only a truthful verdict
    when that bound could have caught a dropped path: on most batches the bfloat16 bound
    swallows the whole gradient, and a dropped path seen 10^4x beyond the bound it is judged
    at must keep its name."""
    lower = LOWER.get(o.precision)
    if lower is None:
        return None
    power = diagnose(o.paths.dE, o.paths, dtype=lower).power  # the reference, at that bound
    return lower if power.input_path and power.output_path else None


def _limited_by_precision(o: Observation, wrong: Array, right: Array) -> bool:
    """Whether ``precision_limited`` is a truthful verdict for the mutant's dE (``wrong`` where
    ``right`` belongs): a lower precision that sees both paths (:func:`_seeing_lower`) holds
    the deviation within its bound.  The judged precision's own bound is added because the
    output is only within it of ``wrong``."""
    lower = _seeing_lower(o)
    if lower is None:
        return False
    tol = _widened(row_bound(o.paths, lower), row_bound(o.paths, o.precision))
    return bool(tol.close(wrong, right).all())


def _same_factors(actual: Array, paths: Paths, tol: Tolerance, got: tuple[float, float],
                  want: tuple[float, float]) -> bool:
    """Whether the fitted path factors ``got`` are the mutant's ``want``, up to what this
    example can tell apart.  Readably equal (1e-3 relative, 1e-6 absolute near 0: far from any
    other catalogue factor) is enough; otherwise putting back the mutant's factor for either
    path must still fit ``actual`` within the row bound.  A path within a few bounds of zero
    (float32, one present row) leaves its factor unresolved, and least squares then returns
    any value that fits; a factor the example does resolve must be the mutant's."""
    if np.allclose(got, want, rtol=1e-3, atol=1e-6):
        return True
    d_in, d_out = _f64(paths.dE_in), _f64(paths.dE_out)
    return all(bool(tol.close(actual, a * d_in + c * d_out).all())
               for a, c in ((want[0], got[1]), (got[0], want[1])))


def _fixed(*labels: str) -> Labels:
    return lambda o: set(labels)


def _scaled_or_weak() -> Labels:
    """``path_scaled``, or the row pattern's label on an example with fewer than three wrong
    entries, where a factor that is not a simple number is no evidence of a scale (see
    ``core.diagnosis._one_factor``)."""
    def labels(o: Observation) -> set[str]:
        wrong = ~row_bound(o.paths, o.precision).close(
            np.asarray(o.returned.dE, np.float64), _f64(o.paths.dE))
        weak = {"input_path_wrong", "output_path_wrong", "unknown"} if wrong.sum() < 3 else set()
        return {"path_scaled"} | weak
    return labels


def _all_present_allows(label: str, *also: str) -> Labels:
    """``label``, or ``also`` when every row is present (the row pattern cannot say more)."""
    def labels(o: Observation) -> set[str]:
        return {label} | (set(also) if _present(o.paths, o.case.V).all() else set())
    return labels


def _combination(mutant: str, statement: str, candidate: Candidate, labels: Labels, *,
                 scales: Callable[[Case], tuple[float, float]] | None = None,
                 strategy: Callable[[], st.SearchStrategy[Case]] = lambda: cases()) -> None:
    def check(target: Target, case: Case) -> None:
        # One call is the whole fingerprint: these mutants are stateless and wrong at once.
        o = first_call(target, case)
        diag, conc = o.diagnosis, o.case
        require_power(diag)
        cand = candidate(o.batch, o.paths)
        tol = row_bound(o.paths, o.precision)
        actual = _f64(o.returned.dE)
        # a path scaled by k carries k times its rounding too (x16: logit-scale-dropped)
        slack = 1.0 if scales is None else max(1.0, *(abs(x) for x in scales(conc)))
        off = ~_scaled(tol, slack).close(actual, cand).all(axis=1)
        if off.any():
            raise SignatureMismatch(mutant, f"dE is not {statement} on rows "
                                    f"{rows_text(np.flatnonzero(off))}", conc, diag)
        ref = _f64(o.paths.dE)
        # Rows within a factor 10 of the bound either way may round to either verdict.
        surely_wrong = ~_scaled(tol, 10.0).close(cand, ref).all(axis=1)
        surely_right = _scaled(tol, 0.1).close(cand, ref).all(axis=1)
        wrong = np.zeros(conc.V, dtype=bool)
        wrong[diag.wrong_rows] = True
        if (surely_wrong & ~wrong).any() or (surely_right & wrong).any():
            raise SignatureMismatch(
                mutant, f"wrong rows {rows_text(diag.wrong_rows)} are not where {statement} "
                f"differs from the sum ({rows_text(np.flatnonzero(surely_wrong))})", conc, diag)
        if not wrong.any():
            if diag.label != "correct":
                raise SignatureMismatch(mutant, f"no row differs, yet {diag.label}", conc, diag)
            return
        if not diag.power.input_path and not diag.power.output_path:
            # Neither path exceeds its bound: no row pattern can name a path, and the diagnosis
            # must not pretend it can.
            if diag.label != "unknown":
                raise SignatureMismatch(mutant, f"a path label ({diag.label}) on an example "
                                        "where neither path is visible", conc, diag)
            return
        allowed = labels(o)
        fits = _fitting_labels(actual, o.paths, tol, diag.scales)
        if _limited_by_precision(o, cand, ref):
            fits.add("precision_limited")
        if allowed is not None and diag.label not in allowed | fits:
            raise SignatureMismatch(mutant, f"diagnosis {diag.label}, expected one of "
                                    f"{sorted(allowed)}", conc, diag)
        if scales is not None and diag.label == "path_scaled":
            want = scales(conc)
            if diag.scales is None or not _same_factors(actual, o.paths, tol, diag.scales, want):
                raise SignatureMismatch(mutant, f"fitted scales {diag.scales}, expected {want}",
                                        conc, diag)

    SIGNATURES[mutant] = Signature(mutant, f"dE = {statement}", _kinds(mutant), strategy, check)


_combination("output-path-only", "dE_out (absent rows exact, present rows wrong)",
             lambda b, p: _f64(p.dE_out), _fixed("input_path_missing"))
_combination("input-path-only", "dE_in (every row with an output path wrong)",
             lambda b, p: _f64(p.dE_in), _fixed("output_path_missing"))
_combination("output-path-overwritten",
             "dE_in on rows of batch tokens, dE_out elsewhere (absent rows exact)",
             lambda b, p: np.where(_present(p, b.E.shape[0])[:, None], _f64(p.dE_in),
                                   _f64(p.dE_out)),
             _all_present_allows("output_path_overwritten", "output_path_missing"))
_combination("paths-averaged", "(dE_in + dE_out) / 2",
             lambda b, p: (_f64(p.dE_in) + _f64(p.dE_out)) / 2,
             _scaled_or_weak(), scales=lambda c: (0.5, 0.5))
_combination("input-path-doubled", "2 dE_in + dE_out",
             lambda b, p: 2 * _f64(p.dE_in) + _f64(p.dE_out),
             _scaled_or_weak(), scales=lambda c: (2.0, 1.0))
_combination("logit-scale-dropped", f"dE_in + dE_out / {LOGIT_SCALE}",
             lambda b, p: _f64(p.dE_in) + _f64(p.dE_out) / LOGIT_SCALE, _scaled_or_weak(),
             scales=lambda c: (1.0, 1 / LOGIT_SCALE))
_combination("input-path-sum-not-mean", "N dE_in + dE_out",
             lambda b, p: p.tokens.shape[0] * _f64(p.dE_in) + _f64(p.dE_out),
             _scaled_or_weak(), scales=lambda c: (float(c.N), 1.0))
_combination("s-in-missing-in-backward", "dE_in / s_in + dE_out (right when s_in = 1)",
             lambda b, p: _f64(p.dE_in) / b.s_in + _f64(p.dE_out), _scaled_or_weak(),
             scales=lambda c: (1 / c.s_in, 1.0))
for _name, _which in (("duplicates-buffered", "last"), ("duplicates-last-only", "last"),
                      ("duplicates-first-only", "first")):
    _combination(_name, f"the {_which} occurrence of each token + dE_out (only rows of "
                        "repeated tokens wrong)",
                 lambda b, p, w=_which: _occurrence(p, w) + _f64(p.dE_out),  # type: ignore[misc]
                 _fixed("duplicates_not_accumulated"), strategy=lambda: cases(
                     compositions=REPEATING))
_combination("padding-row-masked",
             "dE_in without the positions of token 0 + dE_out (only row 0 wrong)",
             lambda b, p: _without_token_zero(p) + _f64(p.dE_out),
             # all positions token 0: the whole input path is missing; else only row 0 is
             lambda o: {"input_path_missing" if (o.paths.tokens == 0).all()
                        else "input_path_wrong"},
             strategy=lambda: cases(compositions=("with-zero", "one-token", "random")))


def _wrong_output_path(o: Observation, actual: Array) -> set[str] | None:
    """Labels for a wrong output path: output_path_wrong once some absent row is surely wrong
    (unknown too where a misrouted input path would look the same)
    (path_scaled too when the wrong head gradient happens to be a multiple of g.T @ h, e.g.
    d = 1 and one distinct token).  None (any wrong label) when no absent row is surely wrong:
    then the row pattern cannot tell which path is at fault."""
    tol = row_bound(o.paths, o.precision)
    absent = ~_present(o.paths, o.case.V)
    surely = ~_scaled(tol, 10.0).close(actual, _f64(o.paths.dE)).all(axis=1)
    if not (surely & absent).any():
        return None
    # present rows wrong too, and no more wrong absent rows than positions: the input path
    # scattered into the wrong rows would look the same, so unknown is honest there
    wrong = ~tol.close(actual, _f64(o.paths.dE)).all(axis=1)
    rows = np.flatnonzero(wrong & absent)
    ambiguous = bool((wrong & ~absent).any()) and rows.shape[0] <= o.case.N and \
        misrouted_input_fits(o.paths, rows, actual[rows] - _f64(o.paths.dE_out)[rows], tol)
    return {"output_path_wrong"} | ({"unknown"} if ambiguous else set()) | (
        {"path_scaled"} if _scaled_paths_fit(actual, o.paths, tol, o.diagnosis.scales)
        else set())


_combination("output-path-from-x", "dE_in + g.T @ x (absent rows wrong)", _output_from_x,
             lambda o: _wrong_output_path(o, _output_from_x(o.batch, o.paths)),
             strategy=lambda: cases(compositions=LEAVING_ROWS_ABSENT))


# --- the others ----------------------------------------------------------------------------

def _register(mutant: str, strategy: Callable[[], st.SearchStrategy[Case]] = lambda: cases()
              ) -> Callable[[SignatureCheck], SignatureCheck]:
    def deco(check: SignatureCheck) -> SignatureCheck:
        SIGNATURES[mutant] = Signature(mutant, (check.__doc__ or "").strip(), _kinds(mutant),
                                       strategy, check)
        return check
    return deco


def _first_right(mutant: str, target: Target, case: Case) -> Observation:
    """The first call after a reset, which a stateful mutant gets right (discarded when the
    example has no power: a right first call would then prove nothing)."""
    reset_state()
    first = first_call(target, case)
    require_power(first.diagnosis)
    if first.label != "correct":
        raise SignatureMismatch(mutant, "the first call after a reset is wrong", first.case,
                                first.diagnosis)
    return first


@_register("grad-not-zeroed")
def _grad_not_zeroed(target: Target, case: Case) -> None:
    """After a reset the first call is right; a second identical call returns the first call's
    dE plus the right one (twice the gradient); and observed the way ``tyingspec check``
    observes it (first call, then the kind's second call) the verdict, on the second call, is
    gradient_not_zeroed."""
    first = _first_right("grad-not-zeroed", target, case)
    again = call(target, first.batch)
    precision = precision_for(target, first.returned, again)
    stale = _f64(first.returned.dE) + _f64(first.paths.dE)
    # the second dE is the first plus a fresh gradient, each within its own bound: factor 2
    if not agree("dE", again.dE, stale, first.paths, precision, factor=2.0).all():
        raise SignatureMismatch("grad-not-zeroed", "the second identical call is not the "
                                "first call's dE plus the reference",
                                first.case, judge(again, first.paths, precision))
    reset_state()
    o = observe(target, case)
    if o.stage != AFTER_STEP or o.label != "gradient_not_zeroed":
        raise SignatureMismatch("grad-not-zeroed", f"observed: {o.label} on the {o.stage}, "
                                f"expected gradient_not_zeroed {AFTER_STEP}", o.case,
                                o.diagnosis, o.stage)


@_register("copy-tie")
def _copy_tie(target: Target, case: Case) -> None:
    """The first call is right (U = E); after one SGD step of E along the returned dE, the
    gradient is that of an *untied* model whose head U took the same step with the output
    path only: dE(E1) = dE_in(E1, U1) + dE_out(E1, U1) with U1 = E0 - lr dE_out(E0).  Observed
    the way ``tyingspec check`` observes it, the verdict is tie_is_a_copy after the step
    whenever the call at E1 is wrong against the tied reference there, and correct otherwise
    (a step too small to separate the copies)."""
    first = _first_right("copy-tie", target, case)
    moved = sgd_step(first.batch, first.returned.dE)
    if moved is None:
        discard("the returned gradient is zero: the step would not move E")
    stepped, lr = moved
    # The engine's second call: the stepped batch, cut to its first positions.
    keep = min(SECOND_CALL_POSITIONS, stepped.tokens.shape[0])
    short = replace(stepped, tokens=stepped.tokens[:keep], targets=stepped.targets[:keep])
    second = call(target, short)
    precision = precision_for(target, second)
    b0 = first.batch
    U1 = (b0.E.astype(np.float64) - lr * _f64(first.paths.dE_out)).astype(b0.E.dtype)
    untied = closed_form_paths(short.E.astype(np.float64), b0.W.astype(np.float64),
                               None if b0.b is None else b0.b.astype(np.float64), short.tokens,
                               short.targets, short.res, short.s_in,
                               E_out=U1.astype(np.float64))
    verdict = judge(second, reference(target, short), precision)
    if not row_bound(untied, precision).close(_f64(second.dE), _f64(untied.dE)).all():
        raise SignatureMismatch("copy-tie", "after the step dE is not the untied gradient at "
                                "(E1, U1)", first.case, verdict, AFTER_STEP)
    reset_state()
    o = observe(target, case)
    want: tuple[str, Stage] = ("tie_is_a_copy", AFTER_STEP) if verdict.wrong else \
        ("correct", FIRST_CALL)
    if (o.label, o.stage) != want:
        raise SignatureMismatch("copy-tie", f"observed: {o.label} on the {o.stage}, expected "
                                f"{want[0]} on the {want[1]} (the call at E1 is "
                                f"{verdict.label} against the tied reference)", o.case,
                                o.diagnosis, o.stage)


@_register("sorts-tokens-in-place")
def _sorts(target: Target, case: Case) -> None:
    """The gradient is right and exactly ``tokens`` is written into, whenever the batch is not
    already sorted: diagnosed inputs_mutated."""
    o = first_call(target, case)
    require_power(o.diagnosis)
    want = () if (np.diff(o.batch.tokens) >= 0).all() else ("tokens",)
    if o.returned.mutated != want:
        raise SignatureMismatch("sorts-tokens-in-place", f"mutated {o.returned.mutated}, "
                                f"expected {want}", o.case, o.diagnosis)
    expect = "inputs_mutated" if want else "correct"
    if o.label != expect:
        raise SignatureMismatch("sorts-tokens-in-place", f"diagnosis {o.label}, expected "
                                f"{expect}", o.case, o.diagnosis)


@_register("db-sum-not-mean")
def _db_sum(target: Target, case: Case) -> None:
    """dE, dW and the loss are right; db is N times the reference (diagnosed
    other_gradient_wrong whenever that differs from db beyond its bound, i.e. N > 1 with b
    present on any example with power)."""
    o = first_call(target, case)
    diag, conc = o.diagnosis, o.case
    require_power(diag)
    bad = {c.name for c in diag.others if not c.ok}
    if bad & {"loss", "dW"}:
        raise SignatureMismatch("db-sum-not-mean", f"wrong {sorted(bad)}", conc, diag)
    allowed = {"other_gradient_wrong"} if bad else {"correct"}
    if o.paths.db is not None:
        want = conc.N * _f64(o.paths.db)
        # N times a result within its bound: N times the bound (rtol follows |want|)
        if not agree("db", o.returned.db, want, o.paths, o.precision, factor=conc.N).all():
            raise SignatureMismatch("db-sum-not-mean", "db is not N * db_ref", conc, diag)
        lower = _seeing_lower(o)
        if bad and lower is not None and agree("db", want, o.paths.db, o.paths, lower).all():
            allowed.add("precision_limited")  # x N is within the next precision's rounding
    if diag.label not in allowed:
        raise SignatureMismatch("db-sum-not-mean", f"diagnosis {diag.label}, expected one of "
                                f"{sorted(allowed)}", conc, diag)


def missing_signatures() -> list[str]:
    """Mutants in the registry without a fingerprint here (should be empty)."""
    return [impl.name for impl in builtins().values() if not impl.correct
            and impl.name not in SIGNATURES]


def describe() -> dict[str, str]:
    """Mutant -> its fingerprint statement (for reports)."""
    return {name: s.statement for name, s in SIGNATURES.items()}
