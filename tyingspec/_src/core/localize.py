"""Localise the wrong rows of a claimed dL/dE from the forward alone, by group testing.

A claimed gradient ``G [V, d]`` of a scalar loss ``L(E)`` is checked against the loss alone,
without forming a ``V * d`` Jacobian.  A *directional test* on a set ``S`` of rows draws a
seeded Gaussian direction ``D`` on those rows (unit-variance entries) and compares the
derivative of ``t -> L(E + t D)`` at 0, taken by central differences, with ``pred =
<G[S], D>``.  A set that agrees is cleared; one that disagrees is split in halves and each half
is tested with a fresh direction, down to single rows.  With ``k`` wrong rows among ``V`` that
is about ``2 k log2(V)`` tests of 6 evaluations each, against ``2 V d`` evaluations for a full
finite-difference Jacobian (measured: ``python -m benchmarks.bench_localize``).

**The derivative.**  Central differences ``fd_h = (L(h) - L(-h)) / 2h`` at ``h = t, t/2, t/4``
(6 evaluations), extrapolated twice (Richardson)::

    r1 = (4 fd_{t/2} - fd_t) / 3,   r2 = (4 fd_{t/4} - fd_{t/2}) / 3     error O(t^4)
    fd = (16 r2 - r1) / 15 = (64 fd_{t/4} - 20 fd_{t/2} + fd_t) / 45    error O(t^6)

**The tolerance** of one test::

    allowed = SAFETY * (trunc + noise + dot) + RTOL * sum|G[S] * D|
    trunc   = |r1 - r2|                                    truncation estimate
    noise   = NOISE_GAIN * eta / t                         the loss's rounding, through fd
    eta     = max(KAPPA * u * Lambda, |residual| / RESIDUAL_GAIN)
    Lambda  = max(loss_scale, |L| at every point evaluated)
    dot     = (129 + log2 n) u sum|G[S] * D|               pred: products, pairwise sum

- *Truncation* (absolute): with ``fd_h = g + a h^2 + b h^4 + O(h^6)``, ``r1 - r2 = -15 b t^4
  / 64`` is 15 times the error of ``r2``, and ``fd`` has only the ``O(t^6)`` remainder, far
  below ``trunc`` once ``t`` is small enough for each term to dominate the next.  A failing
  test whose ``trunc`` is not small against ``|fd|`` (``> |fd| / ASYMPTOTIC``) may be outside
  that regime, so it is re-run at a step 8 times smaller before it may condemn a set.
- *Rounding of the loss* (absolute): each evaluation is off by at most ``eta``; ``fd`` puts
  coefficients summing to ``NOISE_GAIN / t = 2 (128 + 20 + 1/2) / 45t`` on those errors.
  ``eta`` is modelled as ``KAPPA u Lambda``: a float64 loss built from terms the size of
  ``Lambda`` (on the probe model the rounding seen is about ``0.4 u |L|``; ``KAPPA = 16`` is
  the margin).  It is never taken below what the test itself shows: the even parts
  ``(L(h) + L(-h)) / 2`` at ``h = t/4, t/2, t`` and ``L(0)`` fit ``L0 + c2 h^2 + c4 h^4`` up to
  an ``O(t^6)`` term, so the residual of that fit is rounding (coefficients summing to
  ``RESIDUAL_GAIN``) plus a smooth part that only makes the bound larger.  ``loss_scale``
  (default 1: a mean cross-entropy is O(1)) is for losses built from intermediates larger than
  the loss, e.g. a saturated softmax whose loss rounds to 0 while its logits are in the
  hundreds; pass the size of the largest such term.
- *The claimed gradient's own rounding* (relative): a float64 backward rounds each entry by
  about ``k u`` of the magnitudes summed into it; ``RTOL = 2**-40`` (``k`` up to 8192) of
  ``sum|G[S] * D|`` allows it.

``SAFETY = 2`` doubles the sum.  Nothing is compared with ``==``: a set is condemned only when
the disagreement exceeds every error the forward's rounding and the stencil can explain.  On
the probe model at random shapes and scales (fitted, saturated and repeated-token batches
included) the largest ``|fd - pred| / allowed`` seen for a correct gradient was 0.27.

**The step** is adapted.  ``trunc`` grows like ``t^4`` and ``noise`` shrinks like ``1/t``;
their sum is least at ``trunc = noise / 4``, so after each test the step moves by ``(noise /
(4 trunc))^(1/5)`` (growing at most 2x per test: ``trunc`` varies a lot with the direction),
and by 2x when ``trunc`` is hidden under the rounding.  The first test starts at ``1e-3 *
e_scale`` and calibrates: it is re-run (fresh directions, growing up to 4x) until the two are
within ``BALANCED`` of each other.  Each set inherits the step its parent's test adapted to,
because curvature differs a lot between parts of E (the batch's token rows against absent
ones).  The step stays within ``[1e-9, 1] * e_scale``; pass ``e_scale`` as the typical
magnitude of E's entries (``float(E.std())`` or the init scale).

**Power.**  A wrong row ``r`` with error ``e_r`` moves ``pred`` by ``<e_r, D_r>``, a Gaussian
of standard deviation ``|e_r|``, so a test of a set holding it misses it with probability
about ``0.8 allowed / |e_r|``.  Three guards against such unlucky projections: the whole set
is cleared only by two passing directions; when a disagreeing set's two halves both agree they
are tested again (``REVISITS`` times) with fresh directions; a passing test run at a step where
``trunc`` swamped the rounding is re-run at a better one.  ``allowed`` is set by ``trunc +
noise`` of the set; over a sweep of the probe model (V up to 5000, E's scale 0.02 to 3) it was
a median ``1e-9`` of ``|pred|`` (90th percentile ``1e-7``), so rows of ordinary size are
found at relative errors of ``1e-4`` of their norm, while a row far below the set's scale (an
absent token whose softmax probability is ``1e-20``) is out of reach however wrong it is
relative to its own norm.

**Single rows are confirmed**: a row is reported only after two independent directions
disagree on it alone.

Everything is numpy and float64; the loss is reached only through ``loss_along``, so the same
code checks a numpy probe or a torch module (the caller perturbs and restores its own E).
``L(E)`` itself is asked for as ``loss_along(<no rows>, <[0, d] zeros>, 0.0)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tyingspec._src.core.errors import TyingspecError

__all__ = ["BudgetExceeded", "Localization", "LossAlong", "NonFiniteLoss", "fails_without",
           "localize"]

#: ``loss_along(rows, D, t)`` = ``L(E + t * D_full)``, ``D_full`` zero outside ``rows``.
LossAlong = Callable[[NDArray[np.intp], NDArray[np.float64], float], float]

#: Unit roundoff of float64.
U = 2.0**-53
#: One loss evaluation is taken to be off by at most ``KAPPA * U * Lambda``.
KAPPA = 16.0
#: The claimed gradient's own float64 rounding, relative to ``sum|G * D|``.
RTOL = 2.0**-40
#: Sum of |coefficients| (times t) that the stencil puts on the loss values:
#: ``(64 fd_c - 20 fd_b + fd_a) / 45`` with ``fd_h`` = ``(L(h) - L(-h)) / 2h``.
NOISE_GAIN = 2 * (64 * 2 + 20 * 1 + 0.5) / 45
#: Sum of |coefficients| the even-part residual puts on the loss values' rounding errors.
RESIDUAL_GAIN = 1 + 64 / 45 + 4 / 9 + 1 / 45
#: Every error estimate is doubled before a set may be condemned.
SAFETY = 2.0
#: The first step and the range the step may adapt in, in units of ``e_scale``.
FIRST_STEP = 1e-3
STEP_RANGE = (1e-9, 1.0)
#: A passing test is trusted when ``trunc <= BALANCED * noise`` (the modelled noise; and, for
#: the first test, which calibrates the step, ``trunc >= noise / BALANCED``); the least
#: ``trunc + noise`` is at ``trunc = noise / 4``.
BALANCED = 8.0
#: A failing test is trusted when ``trunc <= |fd| / ASYMPTOTIC`` (the step is small enough
#: that the ``t^4`` term dominates what Richardson leaves, so ``trunc`` estimates it).
ASYMPTOTIC = 8.0
#: Re-tests of both halves of a disagreeing set when both agree (see ``_search``).
REVISITS = 2
#: Runs of the first test (which calibrates the step), and at most of any later one.
CALIBRATION = 6
ATTEMPTS = 2
#: When no single row confirms what a set's test showed, the loss is read at this many points
#: along that test's direction, over its step, and a polynomial of ``KINK_DEGREE`` fitted
#: through them: a loss further than ``KINK_RESIDUAL`` times its rounding (``KAPPA * unit *
#: Lambda``) from it is not smooth on that step (see :meth:`_Tester.smooth_along`).
KINK_POINTS = 33
KINK_DEGREE = 10
KINK_RESIDUAL = 6.0
#: Failing tests read that way at most (each costs ``KINK_POINTS - 1`` evaluations).
KINK_TESTS = 4


@dataclass(frozen=True)
class Localization:
    """What :func:`localize` found.

    ``wrong_rows`` are the rows whose claimed gradient disagrees with the forward (sorted);
    ``evaluations`` the loss evaluations used (6 per directional test, plus 1 for ``L(E)``);
    ``probes`` the directional tests run (re-runs at a better step included); ``worst`` the
    largest ``|fd - <G[S], D>| / allowed`` over those tests (> 1: some set disagreed), leaving
    out the ``kinked`` ones: failing tests that no single row confirmed, along whose direction
    the loss is not smooth on the test's step (a router that switches experts under a
    perturbation that large: its central differences measure the switch, not the derivative).
    """

    wrong_rows: tuple[int, ...]
    evaluations: int
    probes: int
    seed: int
    worst: float
    kinked: int = 0


class NonFiniteLoss(TyingspecError, ValueError):
    """``loss_along`` returned NaN or an infinity."""


class BudgetExceeded(TyingspecError, RuntimeError):
    """Localisation needed more than ``max_evaluations`` loss evaluations.

    ``found`` holds the rows already confirmed wrong and ``unresolved`` the number of rows in
    sets not yet decided.
    """

    def __init__(self, message: str, found: tuple[int, ...], unresolved: int) -> None:
        super().__init__(message)
        self.found = found
        self.unresolved = unresolved


@dataclass(frozen=True)
class _Failed:
    """A directional test that disagreed: where, along what, at what step, by how much, and
    the size of the loss's terms there (``Lambda``, what its rounding is counted from)."""

    rows: NDArray[np.intp]
    D: NDArray[np.float64]
    t: float
    ratio: float
    lam: float


@dataclass(frozen=True)
class _Verdict:
    agrees: bool
    ratio: float
    step: float  # the step the next test of these rows (or of a part of them) should use


class _Tester:
    """Runs directional tests, counts evaluations, adapts the step."""

    def __init__(self, loss_along: LossAlong, grad: NDArray[np.float64], seed: int,
                 e_scale: float, loss_scale: float, max_evaluations: int,
                 unit: float = U, grad_rtol: float = RTOL) -> None:
        self.loss_along = loss_along
        self.grad = grad
        self.rng = np.random.default_rng(seed)
        self.loss_scale = loss_scale
        self.max_evaluations = max_evaluations
        self.unit, self.grad_rtol = unit, grad_rtol
        # A loss computed at a coarser precision than float64 rounds by unit, not U: below
        # sqrt(unit / U) times the float64 floor a step only measures that rounding.
        self.t_min = STEP_RANGE[0] * e_scale * math.sqrt(unit / U)
        self.t_max = STEP_RANGE[1] * e_scale
        self.evaluations = 0
        self.probes = 0
        self.worst = 0.0
        self.worst_agreeing = 0.0
        self.failed: list[_Failed] = []
        self.found: list[int] = []
        self.pending = 0
        self.l0 = 0.0

    def evaluate(self, rows: NDArray[np.intp], D: NDArray[np.float64], t: float) -> float:
        if self.evaluations >= self.max_evaluations:
            raise BudgetExceeded(
                f"localize: max_evaluations={self.max_evaluations} reached with "
                f"{len(self.found)} wrong rows found and {self.pending} rows undecided",
                tuple(sorted(self.found)), self.pending)
        self.evaluations += 1
        value = self.loss_along(rows, D, t)
        try:
            out = float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"localize: loss_along returned {type(value).__name__} "
                            f"{value!r}, expected a float") from exc
        if not math.isfinite(out):
            where = ("at E itself (t = 0)" if t == 0 else
                     f"at step t={t:.3g} along a Gaussian direction on {rows.size} rows "
                     f"(first rows {rows[:8].tolist()})")
            raise NonFiniteLoss(f"localize: loss_along returned {out!r} {where}; the loss "
                                "must be finite there to check the gradient against it")
        return out

    def start(self, rows: NDArray[np.intp]) -> None:
        self.l0 = self.evaluate(rows[:0], np.zeros((0, self.grad.shape[1])), 0.0)

    def test(self, rows: NDArray[np.intp], step: float) -> _Verdict:
        """One directional test on ``rows`` starting at ``step``, re-run (fresh direction) at
        a better step when its verdict is not trustworthy at the step it used."""
        G = self.grad[rows]
        verdict = _Verdict(True, 0.0, step)
        # The first test also calibrates the step: it is re-run until trunc and noise are near
        # balance.  Later tests start from the step their parent adapted to and re-run a
        # passing verdict only when trunc swamped the rounding.
        first = self.probes == 0
        for _ in range(CALIBRATION if first else ATTEMPTS):
            D = self.rng.standard_normal(G.shape)
            t = step
            at = {s: self.evaluate(rows, D, s * t) for s in (1, -1, 0.5, -0.5, 0.25, -0.25)}
            self.probes += 1
            fd_a = (at[1] - at[-1]) / (2 * t)  # central differences at t, t/2, t/4
            fd_b = (at[0.5] - at[-0.5]) / t
            fd_c = (at[0.25] - at[-0.25]) * 2 / t
            r1 = fd_b + (fd_b - fd_a) / 3  # Richardson: the t^2 terms cancel
            r2 = fd_c + (fd_c - fd_b) / 3
            fd = r2 + (r2 - r1) / 15  # and the t^4 terms: (64 fd_c - 20 fd_b + fd_a) / 45
            prod = (G * D).ravel()
            pred = float(prod.sum())
            mag = float(np.abs(prod).sum())
            # numpy sums a whole array pairwise over blocks of at most 128 added in sequence:
            # error <= (128 + log2 n) u sum|x|, plus u sum|x| for the rounded products
            dot = (129 + math.log2(max(prod.size, 1))) * U * mag
            trunc = abs(r2 - r1)
            lam = max(self.loss_scale, abs(self.l0), *(abs(v) for v in at.values()))
            even = {s: (at[s] + at[-s]) / 2 for s in (0.25, 0.5, 1)}
            # L0 + c2 h^2 + c4 h^4 + O(h^6) fitted through the even parts at h = t/4, t/2, t
            # and L0 (h^2 = 0, 1, 4, 16 in units of (t/4)^2): what the fit cannot explain is
            # rounding, up to a c6 t^6 / 64 smooth part.
            residual = self.l0 - 64 / 45 * even[0.25] + 4 / 9 * even[0.5] - even[1] / 45
            eta = max(KAPPA * self.unit * lam, abs(residual) / RESIDUAL_GAIN)
            noise = NOISE_GAIN * eta / t
            allowed = SAFETY * (trunc + noise + dot) + self.grad_rtol * mag
            disagreement = abs(fd - pred)
            if allowed > 0:
                ratio = disagreement / allowed
            else:  # a loss constant to the last bit along D and a zero claim on these rows
                ratio = 0.0 if disagreement == 0 else math.inf
            verdict = _Verdict(ratio <= 1, ratio, t)
            # Next step: trunc ~ c t^4 and noise ~ c' / t; their sum is least at trunc =
            # noise / 4, so move by (noise / (4 trunc))^(1/5), shrinking freely but growing
            # at most 2x per test (4x while calibrating): trunc varies a lot with the direction.
            grow = 4.0 if first else 2.0
            # Balanced against the modelled rounding: the measured floor grows with t^5 at
            # large steps (its smooth part) and would push the step up further.
            modelled = NOISE_GAIN * KAPPA * self.unit * lam / t
            r = trunc / modelled if modelled > 0 else math.inf
            if r < 1 / 8:
                # The truncation error is hidden under rounding (trunc carries its own share of
                # the rounding, which shrinks like 1 / t as noise does): grow until it shows.
                move = grow
            else:
                move = min(grow, max(1 / 16, (4 * r) ** -0.2))
            if not verdict.agrees and trunc > abs(fd) / ASYMPTOTIC:
                # The leading term may not dominate the truncation error yet: smaller step.
                move = min(move, 1 / 8)
            step = min(self.t_max, max(self.t_min, t * move))
            verdict = _Verdict(verdict.agrees, verdict.ratio, step)
            # A pass is trusted when trunc did not swamp the rounding (and, while calibrating,
            # did show above it), or when the step cannot move further.
            settled = step == t or (r <= BALANCED and (not first or r >= 1 / BALANCED))
            if verdict.agrees and settled:
                break
            if not verdict.agrees and trunc <= abs(fd) / ASYMPTOTIC:
                break
        self.worst = max(self.worst, verdict.ratio)
        if verdict.agrees:
            self.worst_agreeing = max(self.worst_agreeing, verdict.ratio)
        else:
            self.failed.append(_Failed(rows, D, t, verdict.ratio, lam))
        return verdict

    def smooth_along(self, test: _Failed) -> bool:
        """Whether the loss along ``test.D`` on its rows is, over ``[-t, t]``, a polynomial of
        ``KINK_DEGREE`` up to ``KINK_RESIDUAL`` times its rounding.  A smooth loss is (the
        step was chosen where the stencil's fourth-order error is near the rounding, so the
        eleventh-order remainder is far below it); a kink or a jump inside the step is not,
        whatever the gradient claims.  Measured on transformers' MiniCPM5-MoE in float32: the
        test that failed with no row confirming it was 11.7 times its rounding from the fit,
        every test that agreed at most 1.9 times."""
        s = np.linspace(-1.0, 1.0, KINK_POINTS)
        values = np.array([0.0 if x == 0 else
                           self.evaluate(test.rows, test.D, float(x) * test.t) - self.l0
                           for x in s])
        fit = np.polynomial.polynomial.Polynomial.fit(s, values, KINK_DEGREE)
        return float(np.abs(fit(s) - values).max()) <= \
            KINK_RESIDUAL * KAPPA * self.unit * test.lam


def localize(loss_along: LossAlong, grad: NDArray[np.floating], *, seed: int,
             rows: NDArray[np.integer] | None = None, max_evaluations: int = 20_000,
             e_scale: float = 1.0, loss_scale: float = 1.0, unit: float = U,
             grad_rtol: float = RTOL) -> Localization:
    """Find the rows of a claimed gradient ``grad`` [V, d] that disagree with the loss.

    ``loss_along(rows, D, t)`` must return ``L(E + t * D_full)`` where ``D_full`` is zero
    except on ``rows`` (an int array), which hold ``D`` [len(rows), d]; the caller restores E
    afterwards.  Starting from ``rows`` (default: every row), each set is tested with a fresh
    seeded Gaussian direction; a set that agrees is cleared, one that disagrees is split in
    halves (depth first) until single rows remain, which are re-tested once before being
    reported (the starting set is cleared only by two agreeing directions).  Set
    ``e_scale`` to the typical magnitude of E's entries and ``loss_scale`` to the size of the
    terms the loss is computed from when that exceeds 1 and the loss itself (see the module
    docstring for the tolerance).  ``unit`` is the unit roundoff the loss is really
    computed at (float64's by default; a float32 model's loss rounds by 2**-24) and
    ``grad_rtol`` the claimed gradient's own relative rounding (a float32 backward's is far
    above float64's ``RTOL``).  The result depends only on ``seed`` and the loss.

    Raises ``NonFiniteLoss`` when ``loss_along`` returns NaN/inf, ``BudgetExceeded`` after
    ``max_evaluations`` evaluations, ``ValueError`` for a bad ``grad``/``rows``.
    """
    G = np.asarray(grad, dtype=np.float64)
    if G.ndim != 2:
        raise ValueError(f"localize: grad must be [V, d], got shape {G.shape}")
    if not np.isfinite(G).all():
        bad = np.flatnonzero(~np.isfinite(G).all(axis=1))
        raise ValueError(f"localize: grad has NaN/inf in rows {bad[:8].tolist()}")
    if not (math.isfinite(e_scale) and e_scale > 0):
        raise ValueError(f"localize: e_scale must be finite and > 0, got {e_scale!r}")
    if not (math.isfinite(loss_scale) and loss_scale >= 0):
        raise ValueError(f"localize: loss_scale must be finite and >= 0, got {loss_scale!r}")
    V = G.shape[0]
    if rows is None:
        todo = np.arange(V, dtype=np.intp)
    else:
        todo = np.asarray(rows).reshape(-1)
        if todo.size and (not np.issubdtype(todo.dtype, np.integer)
                          or todo.min() < 0 or todo.max() >= V):
            raise ValueError(f"localize: rows must be integers in [0, {V}), got {todo[:8]}")
        todo = np.unique(todo).astype(np.intp)  # sorted: halves are contiguous row ranges
    if not (0 < unit < 1 and 0 <= grad_rtol < 1):
        raise ValueError(f"localize: unit and grad_rtol must be in (0, 1), got {unit!r}, "
                         f"{grad_rtol!r}")
    tester = _Tester(loss_along, G, seed, e_scale, loss_scale, max_evaluations, unit,
                     grad_rtol)
    if todo.size:
        _search(tester, todo, FIRST_STEP * e_scale)
    worst, kinked = tester.worst, 0
    if not tester.found and tester.failed and len(tester.failed) <= KINK_TESTS:
        # Sets disagreed and no single row confirmed it: a failing test along whose direction
        # the loss is not smooth on its step measured a kink, not the gradient, and is no
        # evidence (the reading is paid for beyond the budget, which is for the search).
        tester.max_evaluations += len(tester.failed) * (KINK_POINTS - 1)
        kept = [f for f in tester.failed if tester.smooth_along(f)]
        kinked = len(tester.failed) - len(kept)
        worst = max([tester.worst_agreeing, *(f.ratio for f in kept)])
    return Localization(wrong_rows=tuple(sorted(tester.found)), evaluations=tester.evaluations,
                        probes=tester.probes, seed=seed, worst=worst, kinked=kinked)


def fails_without(loss_along: LossAlong, grad: NDArray[np.floating],
                  part: NDArray[np.floating] | None, *, seed: int,
                  **options: Any) -> bool:
    """Whether :func:`localize` rejects ``grad - part``: the power of a pass on ``grad``.

    A pass against the forward is evidence only when the same check, with the same budget,
    fails the gradient without one of its paths (``part``, the input path).  A miss here is no
    power, never a failure; running out of budget counts as a rejection (rows disagreed).
    ``options`` are :func:`localize`'s; the probe draws from ``seed + 1``."""
    if part is None or not np.any(part):
        return False
    try:
        probe = localize(loss_along, np.asarray(grad, np.float64) - part, seed=seed + 1,
                         **options)
    except BudgetExceeded:
        return True
    return bool(probe.wrong_rows) or probe.worst > 1


def _search(tester: _Tester, todo: NDArray[np.intp], step: float) -> None:
    """Group testing from the set ``todo``; wrong rows go to ``tester.found``."""
    tester.pending = int(todo.size)
    tester.start(todo)
    # The whole set is cleared only by two independent directions: a miss here (a Gaussian
    # projection of the error that happens to be tiny) would hide every wrong row at once.
    verdict = tester.test(todo, step)
    if verdict.agrees:
        verdict = tester.test(todo, verdict.step)
        if verdict.agrees:
            tester.pending = 0
            return
    # Sets known to disagree, each with the step its own test adapted to: curvature differs a
    # lot between parts of E (the batch's token rows against absent ones), so one global step
    # would be pulled back and forth between them.  Depth first, the lower half first: a
    # search the budget stops has confirmed the rows it went down to, where breadth first it
    # has only split sets (a gradient wrong on all 76 rows of a batch's tokens, transformers'
    # GLM-4 with a detached lookup: 0 rows confirmed in 595 evaluations breadth first).
    stack: list[tuple[NDArray[np.intp], float]] = [(todo, verdict.step)]
    while stack:
        tester.pending = sum(int(part.size) for part, _ in stack)
        subset, step = stack.pop()
        if subset.size == 1:
            # A single row is condemned only by two independent directions (the test that
            # put it here and this one).
            if not tester.test(subset, step).agrees:
                tester.found.append(int(subset[0]))
            continue
        half = subset.size // 2
        halves = (subset[:half], subset[half:])
        for _ in range(1 + REVISITS):
            verdicts = [tester.test(part, step) for part in halves]
            failing = [(part, v.step) for part, v in zip(halves, verdicts) if not v.agrees]
            if failing:
                break
            # The parent disagreed but neither half does: one half's projection of its error
            # was likely tiny by chance, so both are tested again with fresh directions.
        stack.extend(reversed(failing))
    tester.pending = 0
