"""Judging the gathered copies: three named checks, and the label the rows explain.

Each check is a :class:`~core.findings.Finding` per invariant.  A wrong gradient is explained
copy by copy against the reference's components (replica x micro-batch x path, see
:mod:`kinds.distributed.reference`), each comparison under the shared row bound
(:mod:`core.tolerance`) scaled by the coefficients it sums with:

* from the second step of a case on, every wrong copy holds its step's tied gradient plus a
  multiple of its own gradient of the step before: ``gradient_not_zeroed`` (the gradient is
  never zeroed, so the sync sums what the last step left too);
* every copy holds ``G / k`` for one ``k > 1``: ``replicas_averaged``;
* every copy holds ``k G`` for one ``k > 1``: ``path_scaled`` (both paths alike: the copies
  summed over more ranks than the embedding group holds, e.g. the world group of a pp x dp
  layout);
* every copy holds its own stage's path only (the first stage the input path, the last the
  output path) and no copy holds the other stage's: ``replica_not_synced``;
* every wrong copy holds one path reduced and the other path of a single replica alone
  (unreduced, ``dp`` times its averaged share): ``replica_partial_shards`` (Megatron-LM #844);
* every wrong copy lacks components that another copy holds (added after the sum was taken):
  ``replica_synced_early`` (Megatron-LM #1012, #656);
* anything else: ``unknown``, never a confident wrong label.

This module does not import torch: it judges numpy arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.core.labels import Label
from tyingspec._src.core.tolerance import Terms, Tolerance, tolerance_for
from tyingspec._src.kinds.distributed.target import place

CHECK_START = "copies equal at start"
CHECK_GRAD = "gradient after the sync"
CHECK_AFTER = "copies equal after the step"
INV_START = ("every copy of the tied matrix is equal at start, on every rank that holds one, "
             "to the reference's E")
INV_GRAD = ("after the sync, every copy's gradient equals the single-process tied gradient row "
            "by row: both paths, every micro-batch, every DP replica")
INV_AFTER = "the copies are still equal after the optimizer step"
CHECKS = (CHECK_START, CHECK_GRAD, CHECK_AFTER)


@dataclass(frozen=True)
class Part:
    """One component of the reference's tied gradient: one replica's micro-batch's
    contribution along one path (built by :mod:`kinds.distributed.reference`)."""

    replica: int
    micro: int
    path: str  # "input" or "output"
    value: np.ndarray  # [V, d]

    @property
    def name(self) -> str:
        return f"{self.path} path of replica {self.replica} micro-batch {self.micro}"


@dataclass(frozen=True)
class Verdict:
    """One check's outcome on one layout: None when it holds, else (label, detail)."""

    label: Label | None
    detail: str


def terms(parts: Sequence[Part], N: int) -> Terms:
    """The row bound's terms: each row's summed component magnitudes; the reductions a deep
    body adds are covered by a fixed allowance on top of the probe model's lengths."""
    V, d = parts[0].value.shape
    rows = np.sum([np.abs(p.value).max(axis=1) for p in parts], axis=0)
    return Terms(rows=rows, k=float(d + N + np.sqrt(V) + 64))


def _rows(mask: np.ndarray) -> str:
    bad = np.flatnonzero(mask)
    shown = ", ".join(str(int(r)) for r in bad[:8]) + (", ..." if bad.size > 8 else "")
    return f"rows {shown} ({bad.size} of {mask.size})"


def _close(tol: Tolerance, actual: np.ndarray, expected: np.ndarray, factor: float = 1.0
           ) -> np.ndarray:
    """Per row: every entry within the bound (``factor``: a sum of that many such terms)."""
    atol = np.asarray(tol.atol) * factor
    ok = np.abs(actual - expected) <= atol + tol.rtol * factor * np.abs(expected)
    return np.asarray(ok.all(axis=1))


def start_check(copies: dict[int, np.ndarray], E0: np.ndarray, dp: int) -> Verdict | str:
    """The copies at start: None-like pass, replicas_diverge, or (as a str) the reason the
    target's setup and its reference disagree for every copy (bad input, not a verdict)."""
    tol = tolerance_for("float64", E0)
    off = {r: ~_close(tol, v, E0) for r, v in copies.items()}
    wrong = [r for r, m in off.items() if m.any()]
    if not wrong:
        return Verdict(None, "")
    if len(wrong) == len(copies):
        first = copies[wrong[0]]
        same = all(tol.close(copies[r], first).all() for r in wrong)
        if same:
            return (f"every copy starts equal to the others but not to the reference's "
                    f"{_rows(off[wrong[0]])}: setup and reference must build the same E from "
                    "the same seed")
    return Verdict("replicas_diverge", "; ".join(
        f"{place(r, dp)}'s copy differs at start from the reference's E on {_rows(off[r])}"
        for r in wrong))


def after_check(copies: dict[int, np.ndarray], dp: int, gradient: Verdict | None = None
                ) -> Verdict:
    """The copies after the step.  Copies stepped by gradients that were already wrong differ
    because of those gradients (a copy never synced steps by its own path only): the label is
    then the gradient check's, and ``replicas_diverge`` is kept for copies whose gradients
    were right but whose steps differ."""
    ranks = sorted(copies)
    base = copies[ranks[0]]
    tol = tolerance_for("float64", *copies.values())
    bad = [(r, m) for r in ranks[1:] if (m := ~_close(tol, copies[r], base)).any()]
    if not bad:
        return Verdict(None, "")
    where = "; ".join(f"{place(r, dp)}'s copy differs after the step from "
                      f"{place(ranks[0], dp)}'s on {_rows(m)}" for r, m in bad)
    if gradient is not None and gradient.label is not None:
        return Verdict(gradient.label, f"{where}, as their gradients after the sync already "
                       f"did ({gradient.label}, see the gradient check)")
    return Verdict("replicas_diverge", where)


#: Up to this many components a wrong copy the least-squares fit leaves unexplained is searched
#: subset by subset (2^J combinations).
_SEARCHED = 10


@dataclass(frozen=True)
class _Fit:
    kind: str  # "full", "averaged", "multiplied", "own", "partial", "subset", "carried"
    coef: tuple[float, ...]
    note: str


def gradient_check(grads: dict[int, np.ndarray], parts: Sequence[Part], tol: Tolerance,
                   pp: int, dp: int, previous: dict[int, np.ndarray] | None = None
                   ) -> tuple[Verdict, int | None]:
    """The gradients after the sync, and the rank of the first wrong copy (None if none).
    ``previous``: each copy's gradient after the step before this one on the same setup (from
    the second step on), which a gradient never zeroed still carries."""
    G: np.ndarray = np.sum([p.value for p in parts], axis=0)
    wrong = {r: ~_close(tol, g, G) for r, g in grads.items()}
    wrong = {r: m for r, m in wrong.items() if m.any()}
    if not wrong:
        return Verdict(None, ""), None
    first = min(wrong)
    carried = {r: _carried(grads[r], G, previous.get(r), tol) for r in wrong} \
        if previous else {}
    if carried and all(f is not None for f in carried.values()):
        return Verdict("gradient_not_zeroed", "; ".join(
            f"{place(r, dp)}: {f.note}; wrong {_rows(wrong[r])}"
            for r, f in sorted(carried.items()) if f is not None)), first
    fits = {r: _explain(grads[r], r, parts, tol, pp, dp) if r in wrong else
            _Fit("full", (1.0,) * len(parts), "holds the tied gradient") for r in grads}
    label = _label(wrong, fits, parts, pp, dp)
    lines = []
    for r in sorted(wrong):
        fit = fits[r]
        why = fit.note if fit is not None else "matches no combination of the reference's paths"
        lines.append(f"{place(r, dp)}: {why}; wrong {_rows(wrong[r])}")
    return Verdict(label, "; ".join(lines)), first


def _carried(g: np.ndarray, G: np.ndarray, before: np.ndarray | None, tol: Tolerance
             ) -> _Fit | None:
    """``g`` as this step's tied gradient ``G`` plus ``c`` times the copy's gradient of the
    step before (``c`` > 0; 2 when the sync summed two copies that both carried it)."""
    if before is None:
        return None
    rest = (g - G).ravel()
    scale = float(before.ravel() @ before.ravel())
    if scale == 0.0:
        return None
    c = float(before.ravel() @ rest) / scale
    if c < 0.5 or not _close(tol, g, G + c * before, 1.0 + c).all():
        return None
    return _Fit("carried", (c,), f"holds this step's tied gradient plus {c:.3g}x its gradient "
                "of the step before: the gradient was not zeroed before this step")


def _explain(g: np.ndarray, rank: int, parts: Sequence[Part], tol: Tolerance, pp: int,
             dp: int) -> _Fit | None:
    """The simplest combination of the reference's components that ``g`` equals."""
    J = len(parts)
    values = np.stack([p.value for p in parts])
    stage, replica = rank // dp, rank % dp
    size = pp * dp

    def holds(coef: Sequence[float]) -> bool:
        c = np.asarray(coef, dtype=np.float64)
        expected = np.tensordot(c, values, axes=1)
        return bool(_close(tol, g, expected, max(1.0, float(np.abs(c).sum()))).all())

    for k in range(2, 2 * size + 1):
        if holds([1.0 / k] * J):
            return _Fit("averaged", (1.0 / k,) * J, f"holds the tied gradient divided by {k}")
        if holds([float(k)] * J):
            return _Fit("multiplied", (float(k),) * J, f"holds the tied gradient times {k}: "
                        "the sum ran over more ranks than the embedding group's copies (the "
                        "world group?)")
    own = {"input"} if stage == 0 and stage != pp - 1 else \
        {"output"} if stage == pp - 1 and stage != 0 else set()
    for path in own:
        lacks = "output" if path == "input" else "input"
        for scope, coef in (("every replica's", [1.0 if p.path == path else 0.0
                                                 for p in parts]),
                            ("its own replica's", [1.0 if p.path == path and
                                                   p.replica == replica else 0.0
                                                   for p in parts]),
                            ("its own replica's unreduced", [float(dp) if p.path == path and
                                                             p.replica == replica else 0.0
                                                             for p in parts])):
            if holds(coef):
                return _Fit("own", tuple(coef), f"holds only its own stage's {path} path "
                            f"({scope}); it lacks the {lacks} path")
    if dp > 1:
        for path, other in (("input", "output"), ("output", "input")):
            for q in range(dp):
                for f in (float(dp), 1.0):
                    coef = [1.0 if p.path == other else (f if p.replica == q else 0.0)
                            for p in parts]
                    if holds(coef):
                        return _Fit("partial", tuple(coef), (
                            f"its {path} path is replica {q}'s partial gradient alone (not "
                            f"reduced across the DP group) while its {other} path is "
                            "reduced: the sum added a DP shard's partial result"))
    mine = [j for j, p in enumerate(parts) if p.replica == replica and
            ((p.path == "input" and stage == 0) or (p.path == "output" and stage == pp - 1))]
    lates = (1.0, float(dp)) if dp > 1 else (1.0,)

    def subset(coef: Sequence[float]) -> _Fit:
        missing = [parts[j].name for j in range(J) if coef[j] == 0.0]
        return _Fit("subset", tuple(coef), "lacks the " + ", ".join(missing))

    # The components that fit g best (least squares), each rounded to "absent" or "present"
    # (a component of this rank's own, local before the sum, may be present dp times): one
    # solve instead of 2^J subsets, which at 4 micro-batches x 2 replicas x 2 paths is 65536.
    # The solve cannot miss a subset that holds when the components are independent, as
    # distinct batches make them; the search below covers a small J where they may not be.
    fit = np.linalg.lstsq(values.reshape(J, -1).T, g.ravel(), rcond=None)[0]
    rounded = [min((0.0, *(lates if j in mine else (1.0,))), key=lambda v: abs(v - fit[j]))
               for j in range(J)]
    if any(c == 0.0 for c in rounded) and holds(rounded):
        return subset(rounded)
    if J > _SEARCHED:
        return None
    for n in range(J - 1, -1, -1):
        for S in itertools.combinations(range(J), n):
            for late in lates:
                coef = [(late if j in mine else 1.0) if j in S else 0.0 for j in range(J)]
                if holds(coef):
                    return subset(coef)
    return None


def _label(wrong: dict[int, np.ndarray], fits: dict[int, _Fit | None], parts: Sequence[Part],
           pp: int, dp: int) -> Label:
    chosen = [fits[r] for r in wrong]
    if any(f is None for f in chosen):
        return "unknown"
    kinds = {f.kind for f in chosen if f is not None}
    if kinds == {"averaged"}:
        return "replicas_averaged"
    if kinds == {"multiplied"}:
        return "path_scaled"
    if kinds == {"partial"}:
        return "replica_partial_shards"
    every = [fits[r] for r in fits]
    if kinds == {"own"} and len(wrong) == len(fits) and pp > 1:
        return "replica_not_synced"
    if kinds <= {"own", "subset"} and all(f is not None for f in every):
        # each missing component must be held by another copy: it was there, only later
        for r in wrong:
            f = fits[r]
            assert f is not None
            for j, c in enumerate(f.coef):
                if c == 0.0 and not any(
                        (g := fits[o]) is not None and g.coef[j] != 0.0
                        for o in fits if o != r):
                    return "unknown"
        if len(wrong) < len(fits) or pp > 1:
            return "replica_synced_early"
    return "unknown"


def combine(name: str, invariant: str, verdicts: Sequence[tuple[str, Verdict]],
            detail_ok: str) -> Finding:
    """One finding per invariant over every layout: the first failing layout decides."""
    bad = [(where, v) for where, v in verdicts if v.label is not None]
    if not bad:
        return passed(name, invariant, detail_ok)
    where, v = bad[0]
    assert v.label is not None
    return failed(name, invariant, v.label, f"{where}: {v.detail}")
