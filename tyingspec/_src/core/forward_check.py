"""The forward check's judgement: a claimed tied gradient against the loss alone.

Every kind that runs a user's forward (torch, jax) asks the same question of the gradient
that trains: do directional central differences of the loss agree with it, row set by row set
(:func:`core.localize.localize`)?  What a kind supplies is the one thing that differs between
frameworks, ``loss_along(rows, D, t)`` (its loss with ``E[rows] += t D``), and what it knows of
its model (the precision the loss is computed in, the ids the lookups read, whether autograd
shows each use reaching the table).  Everything else is decided here, once:

- **the agreement rule and the unit roundoff**: the loss is differenced at the unit roundoff
  of the precision it is really computed in (``loss_precision``); the claimed gradient is
  allowed ``16 u`` of its own rounding relative to ``sum |G D|``, ``u`` the roundoff of the
  precision it was computed in: the dtype it is held in or, coarser, the grid every value of
  it lies on (:func:`core.tolerance.computed_in`: a float32 computation handed back as float64
  is judged at float32, never at float64's ``2**-53``);
- **the search budget** (:func:`fd_budget`);
- **localize -> finding**: confirmed rows are named by :func:`core.diagnosis.forward_pattern`;
  a set that disagreed without any single row confirming it is never a failure (rounding
  summed over a set of rows, a correct model at a large batch), unless autograd shows a path
  that never reaches the table, which names it; a pass says how many directions were left out
  as kinked and whether the same check fails the gradient without its input path (power);
- **rows a low precision cannot resolve**: a kind that holds its framework's own gradient of
  the same forward in the same dtype (``same_rounding``) excuses a row that disagrees no more
  than that gradient does; with that excuse, in 16 bits, rows holding the output path alone
  are tested on their own after a pass (the batch's rows dominate a set's tolerance, and a
  path wrong by half on them hides under it; without the excuse such a test would condemn
  their rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tyingspec._src.core.diagnosis import forward_pattern
from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.core.localize import (
    BudgetExceeded,
    Localization,
    LossAlong,
    localize,
)
from tyingspec._src.core.tolerance import (
    UNIT_ROUNDOFF,
    Precision,
    computed_in,
    least_precise,
    unit_of,
)

__all__ = ["AGAINST", "Reference", "fd_budget", "grad_rtol", "judge_against_forward",
           "judged_precision"]

AGAINST = ("the tied gradient agrees with directional central differences of the loss, row "
           "sets split until the disagreeing rows are found")

#: The claimed gradient's relative rounding, in units of its unit roundoff, and its floor
#: (a float64 backward's, ``core.localize.RTOL``).
GRAD_UNITS = 16.0
GRAD_RTOL_FLOOR = 2.0**-40

#: Precisions whose gradients get the absent rows tested alone (see the module docstring).
LOW: tuple[Precision, ...] = ("bfloat16", "float16")


def fd_budget(V: int) -> int:
    """Forward evaluations one localisation may spend: k wrong rows cost ~12 k log2 V, so this
    localises about five rows at any V and stops, with what it found, beyond that (a bug on
    every row needs no more rows to be named)."""
    return int(200 + 60 * np.log2(max(V, 2)))


def judged_precision(own: np.ndarray, held: object) -> Precision:
    """The precision the claimed gradient ``own`` is judged at: the coarser of the dtype it
    was computed in (``held``) and the grid its values lie on."""
    return least_precise(held, computed_in(np.asarray(own)))


def grad_rtol(own: np.ndarray, held: object) -> float:
    """The claimed gradient's own relative rounding (see :func:`judged_precision`)."""
    return max(GRAD_RTOL_FLOOR, GRAD_UNITS * UNIT_ROUNDOFF[judged_precision(own, held)])


@dataclass(frozen=True)
class _Options:
    """What every localisation of one judgement shares."""

    e_scale: float
    unit: float
    grad_rtol: float

    def localize(self, loss_along: LossAlong, G: np.ndarray, seed: int,
                 rows: np.ndarray | None, budget: int) -> Localization:
        return localize(loss_along, G, seed=seed, rows=rows, max_evaluations=budget,
                        e_scale=self.e_scale, unit=self.unit, grad_rtol=self.grad_rtol)


@dataclass(frozen=True)
class Reference:
    """The framework's own gradient of the same forward in the same dtypes (``primal``, [V, d]
    float64) and each row's relative rounding against it (``row_rtol``, [V]): a row of the
    claimed gradient that disagrees with the forward is condemned only where ``primal`` does
    not disagree as much (a difference the dtype cannot tell from its rounding)."""

    primal: np.ndarray
    row_rtol: np.ndarray
    dtype: str

    def condemned(self, G: np.ndarray, rows: Sequence[int]) -> list[int]:
        return [int(r) for r in rows if float(np.abs(G[r] - self.primal[r]).max()) >
                self.row_rtol[r] * float(np.abs(self.primal[r]).max())]


def judge_against_forward(loss_along: LossAlong, own: np.ndarray, *, check: str,
                          seed: int, reads: np.ndarray, vocab: int,
                          loss_precision: object, grad_dtype: object,
                          e_scale: float, invariant: str = AGAINST,
                          rows: np.ndarray | None = None,
                          padding_idx: int | None = None,
                          input_reached: bool = True, output_reached: bool = True,
                          input_path: np.ndarray | None = None,
                          same_rounding: Reference | None = None) -> Finding:
    """Judge ``own`` [V, d] (float64) against ``loss_along``'s directional differences.

    ``reads``: the ids the lookups read; ``loss_precision``: the dtype the loss is computed
    in; ``grad_dtype``: the dtype ``own`` was computed in; ``rows``: the rows whose gradient
    is the loss's derivative (default every row: a kind leaves out rows its declared
    semantics exempt); ``input_reached``/``output_reached``: whether autograd shows each use
    reaching the table; ``input_path``: when given, a pass is also run on ``own`` without it,
    and has power when that one fails."""
    unit = unit_of(loss_precision)
    options = _Options(e_scale, unit, grad_rtol(own, grad_dtype))
    budget = fd_budget(vocab)
    reads = np.asarray(reads, dtype=np.int64).reshape(-1)
    try:
        found = options.localize(loss_along, own, seed, rows, budget)
        if same_rounding is not None:
            found = _absent_alone(loss_along, own, found, seed, reads, vocab, rows, budget,
                                  judged_precision(own, grad_dtype), options)
    except BudgetExceeded as exc:
        # many wrong rows: the rows confirmed so far, and how many are left undecided
        label, why = forward_pattern(list(exc.found), reads, vocab, padding_idx=padding_idx,
                                     input_reached=input_reached, partial=True,
                                     output_reached=output_reached)
        return failed(check, invariant, label,
                      f"rows {list(exc.found)[:16]} (and {exc.unresolved} rows not yet "
                      f"decided) disagree with the forward{why} (stopped at the budget of "
                      f"{budget} forward evaluations)", budget)
    at = f"loss at unit roundoff {unit:.2g}"
    wrong = list(found.wrong_rows) if same_rounding is None else \
        same_rounding.condemned(own, found.wrong_rows)
    if wrong:
        label, why = forward_pattern(wrong, reads, vocab, padding_idx=padding_idx,
                                     input_reached=input_reached,
                                     output_reached=output_reached)
        return failed(check, invariant, label,
                      f"rows {wrong[:16]} disagree with the forward{why} "
                      f"({found.evaluations} forward evaluations, {at})", found.evaluations)
    if found.worst > 1 and not found.wrong_rows:
        if not (input_reached and output_reached):
            # a set disagreed and no single row could be confirmed: a label only from evidence
            # beyond the rows, autograd showing a path that never reaches E
            label = "input_path_missing" if not input_reached else "output_path_missing"
            why = (", and the lookup never reaches E through autograd" if not input_reached
                   else ", and the head never reaches E through autograd")
            return failed(check, invariant, label,
                          f"a set of rows disagreed with the forward ({found.worst:.3g}x its "
                          f"tolerance) but no single row could be confirmed{why}; {at}, "
                          f"{found.evaluations} forward evaluations", found.evaluations)
        # no evidence a correct model could not give (rounding summed over a set of rows at
        # a large batch): never a failure, and said so, without power
        return passed(check, invariant,
                      f"a set of rows disagreed with the forward ({found.worst:.3g}x its "
                      f"tolerance) but no single row could be confirmed, so nothing is "
                      f"named; {at}, {found.evaluations} forward evaluations",
                      found.evaluations, False)
    power = _fails_without(loss_along, own, input_path, seed, rows, budget, options,
                           same_rounding)
    excused = [r for r in found.wrong_rows if r not in wrong]
    note = "" if not excused or same_rounding is None else (
        f"; rows {excused[:16]} disagree with the forward, but by no more than "
        f"{same_rounding.dtype}'s rounding parts them from the framework's own gradient of "
        f"the forward in {same_rounding.dtype}, which disagrees as much: a difference this "
        "dtype cannot tell from its rounding")
    kinked = (f"; {found.kinked} disagreeing direction(s) left out: the loss is not "
              "smooth along them within the step (a kink, such as a router switching "
              "experts), and no row confirmed them") if found.kinked else ""
    return passed(check, invariant, f"{found.evaluations} forward evaluations, {at}" + note
                  + ("; it fails the gradient without its input path" if power else "")
                  + kinked, found.evaluations, power)


def _absent_alone(loss_along: LossAlong, own: np.ndarray, found: Localization, seed: int,
                  reads: np.ndarray, vocab: int, rows: np.ndarray | None, budget: int,
                  precision: Precision, options: _Options) -> Localization:
    """In 16 bits a test allows ``16 u`` of ``sum |G D|`` over its rows, which the rows of the
    batch's tokens (both paths) dominate: a path wrong by half on the rows holding the output
    path alone hides under them.  After a pass, those rows are tested on their own."""
    if precision not in LOW or found.wrong_rows or found.worst > 1:
        return found
    candidates = np.arange(vocab) if rows is None else np.asarray(rows, dtype=np.int64)
    absent = np.setdiff1d(candidates, reads)
    if not 0 < absent.size < vocab:
        return found
    alone = options.localize(loss_along, own, seed + 2, absent,
                             max(budget - found.evaluations, 7))
    return replace(alone, evaluations=found.evaluations + alone.evaluations)


def _fails_without(loss_along: LossAlong, own: np.ndarray, part: np.ndarray | None, seed: int,
                   rows: np.ndarray | None, budget: int, options: _Options,
                   same_rounding: Reference | None) -> bool:
    """Whether the same check, with the same budget and the same excuse, rejects ``own -
    part``: the power of a pass (a miss is no power, never a failure; running out of budget
    counts as a rejection)."""
    if part is None or not np.any(part):
        return False
    without = own - np.asarray(part, dtype=np.float64)
    try:
        probe = options.localize(loss_along, without, seed + 1, rows, budget)
    except BudgetExceeded:
        return True
    confirmed = list(probe.wrong_rows) if same_rounding is None else \
        same_rounding.condemned(without, probe.wrong_rows)
    return bool(confirmed) or (probe.worst > 1 and not probe.wrong_rows)
