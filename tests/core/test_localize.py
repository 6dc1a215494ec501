"""localize: no wrong rows for correct gradients, exactly the wrong rows for broken ones (a row
off by 1e-4 of its norm, a path dropped, duplicates not accumulated), the same answer from the
same seed, O(k log V) evaluations, and clear errors for a non-finite loss or a spent budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tyingspec._src.core.localize import (
    BudgetExceeded,
    Localization,
    NonFiniteLoss,
    _Failed,
    _Tester,
    localize,
)
from tyingspec._src.core.paths import Paths, closed_form_paths, loss_only


@dataclass
class Probe:
    """A probe-model batch and ``loss_along`` over its E (perturbed in place, restored)."""

    E: np.ndarray
    W: np.ndarray
    b: np.ndarray | None
    tokens: np.ndarray
    targets: np.ndarray
    res: float = 1.0
    s_in: float = 1.0
    calls: int = 0

    def paths(self) -> Paths:
        return closed_form_paths(self.E, self.W, self.b, self.tokens, self.targets, self.res,
                                 self.s_in)

    def loss_along(self, rows: np.ndarray, D: np.ndarray, t: float) -> float:
        self.calls += 1
        assert rows.dtype.kind == "i" and D.dtype == np.float64
        assert D.shape == (rows.size, self.E.shape[1])
        keep = self.E[rows].copy()
        self.E[rows] += t * D
        try:
            return loss_only(self.E, self.E, self.W, self.b, self.tokens, self.targets,
                             self.res, self.s_in)
        finally:
            self.E[rows] = keep


def probe(V: int, d: int, N: int, *, scale: float = 1.0, seed: int = 0, distinct: int = 0,
          fitted: bool = False, bias: bool = True, res: float = 1.0,
          s_in: float = 1.0) -> Probe:
    """``distinct`` > 0 draws tokens from that many ids, so tokens repeat."""
    r = np.random.default_rng(seed)
    E = r.normal(0.0, scale, (V, d))
    W = r.normal(0.0, 1 / math.sqrt(d), (d, d))
    b = r.normal(0.0, 0.1, V) if bias else None
    tokens = r.integers(0, min(V, distinct) if distinct else V, N)
    targets = r.integers(0, V, N)
    if fitted:  # targets are the argmax: a small loss, a softmax near saturation
        x = s_in * E[tokens]
        h = res * x + np.tanh(x @ W)
        targets = (h @ E.T + (0.0 if b is None else b)).argmax(axis=1)
    return Probe(E, W, b, tokens, targets, res, s_in)


def run(p: Probe, G: np.ndarray, seed: int = 0, **kw: object) -> Localization:
    scale = float(np.abs(p.E).mean()) or 1.0
    before = p.calls
    out = localize(p.loss_along, G, seed=seed, e_scale=scale, **kw)  # type: ignore[arg-type]
    # every evaluation is counted: 6 per test plus L(E)
    assert out.evaluations == p.calls - before == 6 * out.probes + (1 if out.probes else 0)
    return out


# ---------------------------------------------------------------- (1) no false positives


@settings(max_examples=25, deadline=None)
@given(
    V=st.sampled_from([1, 2, 3, 17, 64, 300, 1000, 5000]),
    d=st.sampled_from([1, 2, 8, 64]),
    N=st.integers(1, 12),
    log_scale=st.floats(-3.0, 0.7),
    repeats=st.booleans(),
    fitted=st.booleans(),
    bias=st.booleans(),
    res=st.sampled_from([0.0, 1.0, 0.5]),
    s_in=st.sampled_from([1.0, 2.0, -0.7]),
    seed=st.integers(0, 2**31 - 1),
)
def test_correct_gradient_has_no_wrong_rows(V: int, d: int, N: int, log_scale: float,
                                            repeats: bool, fitted: bool, bias: bool,
                                            res: float, s_in: float, seed: int) -> None:
    p = probe(V, d, N, scale=10**log_scale, seed=seed, distinct=max(1, N // 3) if repeats else 0,
              fitted=fitted, bias=bias, res=res, s_in=s_in)
    out = run(p, p.paths().dE, seed=seed)
    assert out.wrong_rows == ()
    assert out.worst <= 1.0
    assert out.probes <= 8  # cleared at the top: calibration plus the second direction


def test_rounding_level_differences_are_not_flagged() -> None:
    """The tolerance's relative part: a gradient off by float64 rounding (1e-14 relative, as a
    backward summed in another order would be) agrees."""
    p = probe(512, 16, 12, distinct=4)
    G = p.paths().dE
    r = np.random.default_rng(1)
    out = run(p, G * (1 + 1e-14 * r.standard_normal(G.shape)))
    assert out.wrong_rows == ()


def test_constant_loss_and_zero_claim_agree_and_a_nonzero_claim_does_not() -> None:
    """A loss constant to the last bit: 0 is right everywhere and anything else is wrong."""

    def constant(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        return 3.25

    assert localize(constant, np.zeros((40, 3)), seed=0).wrong_rows == ()
    G = np.zeros((40, 3))
    G[[5, 31]] = 1e-6
    assert localize(constant, G, seed=0).wrong_rows == (5, 31)


def test_any_smooth_loss_not_only_the_probe() -> None:
    """Framework-agnostic: L(E) = sum(A * sin(E)) + (sum E^2)^2 / 4 through ``loss_along``."""
    r = np.random.default_rng(3)
    E = r.normal(size=(300, 5))
    A = r.normal(size=E.shape)

    def along(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        X = E.copy()
        X[rows] += t * D
        return float((A * np.sin(X)).sum() + (X * X).sum() ** 2 / 4)

    G = A * np.cos(E) + (E * E).sum() * E
    assert localize(along, G, seed=1).wrong_rows == ()
    G[[7, 250]] *= 1 + 1e-4
    assert localize(along, G, seed=1).wrong_rows == (7, 250)


# ---------------------------------------------------------------- (2) power


@pytest.mark.parametrize("case", range(10))
def test_rows_off_by_1e4_of_their_norm_are_found_exactly(case: int) -> None:
    r = np.random.default_rng(100 + case)
    V = int(r.choice([64, 512, 4096]))
    d = int(r.choice([4, 16, 64]))
    scale = float(r.choice([0.02, 0.3, 1.0, 3.0]))
    p = probe(V, d, 12, scale=scale, seed=case, distinct=6)
    G = p.paths().dE
    norms = np.linalg.norm(G, axis=1)
    # rows of ordinary size (a row 1e-20 of the largest is below any forward's resolution)
    candidates = np.flatnonzero(norms >= 1e-3 * norms.max())
    wrong = np.sort(r.choice(candidates, min(int(r.integers(1, 4)), candidates.size),
                             replace=False))
    for v in wrong:
        e = r.standard_normal(d)
        G[v] += 1e-4 * norms[v] * e / np.linalg.norm(e)
    assert run(p, G, seed=case).wrong_rows == tuple(wrong.tolist())


def test_a_scaled_and_a_zeroed_row_are_found() -> None:
    p = probe(1000, 16, 12, distinct=6)
    G = p.paths().dE
    token = int(p.tokens[0])
    absent = int(np.setdiff1d(np.arange(1000), p.tokens)[np.argmax(
        np.linalg.norm(G[np.setdiff1d(np.arange(1000), p.tokens)], axis=1))])
    G[token] *= 1.001
    G[absent] = 0.0
    assert run(p, G, seed=7).wrong_rows == tuple(sorted({token, absent}))


@pytest.mark.parametrize("V,d,N", [(64, 8, 12), (1000, 16, 16), (4096, 32, 12)])
def test_input_path_dropped_is_exactly_the_token_rows(V: int, d: int, N: int) -> None:
    p = probe(V, d, N, seed=V, distinct=N // 2)
    paths = p.paths()
    tokens = np.unique(p.tokens)
    assert np.all(np.abs(paths.dE_in[tokens]).max(axis=1) > 0)
    assert run(p, paths.dE_out, seed=1).wrong_rows == tuple(tokens.tolist())


@pytest.mark.parametrize("V,d,N", [(64, 8, 16), (2000, 16, 16)])
def test_duplicates_not_accumulated_is_exactly_the_repeated_tokens(V: int, d: int,
                                                                   N: int) -> None:
    p = probe(V, d, N, seed=2, distinct=5)
    paths = p.paths()
    buffered = np.zeros_like(paths.dE_in)
    buffered[paths.tokens] = paths.per_position  # numpy's buffered `+=`: the last one wins
    ids, counts = np.unique(p.tokens, return_counts=True)
    assert (counts > 1).any()
    out = run(p, paths.dE_out + buffered, seed=3)
    assert out.wrong_rows == tuple(ids[counts > 1].tolist())


def test_output_path_dropped_is_every_row_at_small_v() -> None:
    p = probe(32, 4, 8, seed=4)
    paths = p.paths()
    assert run(p, paths.dE_in, seed=0).wrong_rows == tuple(range(32))


# ---------------------------------------------------------------- (3) determinism


def test_same_seed_same_result_and_other_seeds_same_rows() -> None:
    p = probe(512, 8, 12, distinct=4)
    G = p.paths().dE_out
    a, b = run(p, G, seed=11), run(p, G, seed=11)
    assert a == b and a.seed == 11
    c = run(p, G, seed=12)
    assert c.wrong_rows == a.wrong_rows and c.seed == 12
    assert (c.evaluations, c.worst) != (a.evaluations, a.worst)


# ---------------------------------------------------------------- (4) cost


@pytest.mark.parametrize("seed", range(3))
def test_one_wrong_row_at_4096_costs_about_2_log2_v_tests(seed: int) -> None:
    V = 4096
    p = probe(V, 8, 8, seed=seed, distinct=4)
    G = p.paths().dE
    row = int(p.tokens[0])
    G[row] *= 1.01
    out = run(p, G, seed=seed)
    assert out.wrong_rows == (row,)
    # 1 top-level test, 2 per level below it, 1 confirmation; a few for calibrating the step
    assert out.probes <= 2 * (math.log2(V) + 1) + 6
    assert out.evaluations <= 6 * (2 * (math.log2(V) + 1) + 6) + 1
    assert out.evaluations < V * 8 / 20  # a full Jacobian by central differences: 2 V d


def test_cost_grows_like_k_log_v() -> None:
    for V in (256, 4096):
        p = probe(V, 4, 12, seed=V, distinct=12)
        G = p.paths().dE
        wrong = np.unique(p.tokens)[:4]
        G[wrong] *= 1.01
        out = run(p, G, seed=0)
        assert out.wrong_rows == tuple(wrong.tolist())
        assert out.probes <= 2 * len(wrong) * (math.log2(V) + 1) + 8


def test_rows_restricts_the_search() -> None:
    p = probe(300, 4, 8, seed=6, distinct=3)
    G = p.paths().dE
    G[[10, 200]] *= 1.01
    assert run(p, G, rows=np.arange(100)).wrong_rows == (10,)
    assert run(p, G, rows=np.array([200, 200, 3])).wrong_rows == (200,)
    assert run(p, G, rows=np.array([], dtype=int)) == Localization((), 0, 0, 0, 0.0)


# ---------------------------------------------------------------- guards


def test_non_finite_loss_is_named() -> None:
    p = probe(64, 4, 8)
    G = p.paths().dE

    def blows_up(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        return math.nan if t > 0 else p.loss_along(rows, D, t)

    with pytest.raises(NonFiniteLoss, match=r"returned nan at step t=.* on 64 rows"):
        localize(blows_up, G, seed=0)

    def nan_at_e(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        return math.inf

    with pytest.raises(NonFiniteLoss, match=r"returned inf at E itself"):
        localize(nan_at_e, G, seed=0)


def test_budget_exceeded_reports_what_was_found() -> None:
    p = probe(64, 4, 8, seed=4)
    with pytest.raises(BudgetExceeded, match="max_evaluations=50") as info:
        localize(p.loss_along, p.paths().dE_in, seed=0, max_evaluations=50)
    assert info.value.unresolved > 0
    assert all(0 <= v < 64 for v in info.value.found)


def test_bad_arguments_are_rejected() -> None:
    p = probe(16, 4, 4)
    with pytest.raises(ValueError, match=r"grad must be \[V, d\]"):
        localize(p.loss_along, np.zeros(16), seed=0)
    with pytest.raises(ValueError, match="NaN/inf in rows"):
        localize(p.loss_along, np.full((16, 4), np.nan), seed=0)
    with pytest.raises(ValueError, match="rows must be integers"):
        localize(p.loss_along, np.zeros((16, 4)), seed=0, rows=np.array([3, 16]))
    with pytest.raises(ValueError, match="e_scale"):
        localize(p.loss_along, np.zeros((16, 4)), seed=0, e_scale=0.0)


# --- a loss that is not smooth within the step ---------------------------------------------

def _kinked(eps: float, jump: bool = False) -> tuple[Any, np.ndarray, np.ndarray]:
    """``loss_along``, E and the gradient at E of a smooth loss plus ``0.3 |<a, E - E0> +
    eps|`` (or, with ``jump``, a step of 0.3 where ``<a, E - E0> + eps`` changes sign): a
    kink (a jump) ``eps`` from E along ``a``, as a router whose top experts nearly tie has.
    The gradient is exact at E, on the side E is on."""
    rng = np.random.default_rng(1)
    E0, a = rng.standard_normal((16, 4)), rng.standard_normal((16, 4))

    def loss(E: np.ndarray) -> float:
        s = float((a * (E - E0)).sum()) + eps
        bend = 0.3 * (float(s > 0) if jump else abs(s))
        return float(0.5 * (E * E).sum() + np.log(np.cosh(E)).sum()) + bend

    def along(rows: np.ndarray, D: np.ndarray, t: float) -> float:
        E = E0.copy()
        E[rows] += t * D
        return loss(E)

    return along, E0, E0 + np.tanh(E0) + (0.0 if jump else 0.3 * math.copysign(1, eps)) * a


def test_a_disagreement_no_row_confirms_along_a_kink_is_left_out_and_a_wrong_row_is_not(
        ) -> None:
    """transformers' MiniCPM5-MoE in float32: one direction's central differences, across a
    switch of experts, disagreed with a correct gradient, and no row confirmed it.  Along a
    kink 1e-4 from E, a test of the whole set fails where its halves agree: that test is left
    out (the loss is not smooth within its step), and the correct gradient passes; a row
    really wrong is still found."""
    along, _, grad = _kinked(1e-4)
    found = localize(along, grad, seed=2)
    assert found.wrong_rows == () and found.kinked >= 1 and found.worst <= 1, found
    wrong = grad.copy()
    wrong[5] += 0.2
    assert 5 in localize(along, wrong, seed=2).wrong_rows


@pytest.mark.parametrize("shape", ["smooth", "kink", "jump"])
def test_the_loss_along_a_direction_is_smooth_within_the_step_only_without_a_kink(
        shape: str) -> None:
    """What leaves a failing test out: the loss read at 33 points over ``[-t, t]`` is a
    polynomial of degree 10 up to 6 times its rounding, or not.  A smooth loss is at every
    step a check uses; a kink or a jump inside the step is not."""
    along, E0, grad = _kinked(1e-4, jump=shape == "jump")
    if shape == "smooth":
        along, grad = _kinked(1e4)[0], _kinked(1e4)[2]  # the kink far outside every step
    rows = np.arange(16)
    tester = _Tester(along, grad, 0, 1.0, 1.0, 10_000)
    tester.start(rows)
    D = np.random.default_rng(3).standard_normal((16, 4))
    lam = max(1.0, abs(tester.l0))
    smooth = [tester.smooth_along(_Failed(rows, D, t, 2.0, lam)) for t in (1e-3, 1e-2, 1e-1)]
    assert smooth == [shape == "smooth"] * 3, smooth


def test_a_spent_budget_has_rows_to_show_when_every_row_is_wrong() -> None:
    """The search goes depth first: stopped by its budget on a gradient wrong on every row, it
    has confirmed the rows it went down to (breadth first it would have tested every level of
    split sets, and confirmed none, before any single row)."""
    p = probe(64, 4, 8, seed=4)
    paths = p.paths()
    claimed = paths.dE_in  # the output path dropped: every row of dE is wrong
    wrong = set(np.flatnonzero(np.abs(claimed - paths.dE).max(axis=1) > 0).tolist())
    assert len(wrong) == 64
    with pytest.raises(BudgetExceeded) as info:
        localize(p.loss_along, claimed, seed=0, max_evaluations=400)
    assert len(info.value.found) >= 3
    assert set(info.value.found) <= wrong
    assert info.value.unresolved > 0
