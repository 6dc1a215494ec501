"""The ``linear-ce`` references agree: closed form == sympy == central differences of the contract.

The central differences are taken of a forward written here straight from the contract (not the
closed form's own forward), so the three are independent formulations of one definition.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

from tyingspec._src.core.finite import _central
from tyingspec._src.core.paths import OutputPath, row_block
from tyingspec._src.core.tolerance import Terms, row_tolerance, value_tolerance
from tyingspec._src.kinds.linear_ce.reference import (
    REDUCTIONS,
    VARIANTS,
    CEOptions,
    CEResult,
    linear_ce,
)
from tyingspec._src.kinds.linear_ce.symbolic import symbolic_linear_ce


@dataclass(frozen=True)
class Problem:
    """One call of the contract: inputs, options, upstream gradient and block size."""

    h: np.ndarray
    E: np.ndarray
    targets: np.ndarray
    b: np.ndarray | None
    options: CEOptions
    go: np.ndarray | float | None = None
    block_rows: int | None = None

    def closed(self, variant: str | None = None, dtype: str = "float64") -> CEResult:
        return linear_ce(self.h, self.E, self.targets, self.b, self.options, self.go,
                         variant=variant, dtype=dtype, block_rows=self.block_rows)


def contract_objective(h: np.ndarray, E: np.ndarray, y: np.ndarray, b: np.ndarray | None,
                       o: CEOptions, go: np.ndarray | float | None) -> float:
    """The scalar whose gradient the contract returns, written term by term from its text:
    go * L for mean/sum, sum_i go_i L_i for none."""
    a = o.logit_scale * (h @ E.T + (0.0 if b is None else b))
    z = a if o.softcap is None else o.softcap * np.tanh(a / o.softcap)
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    live = y != o.ignore_index
    y0 = np.where(live, y, 0)
    loss = (lse - (1 - o.label_smoothing) * z[np.arange(len(y)), y0]
            - o.label_smoothing * z.mean(axis=1) + o.lse_square_scale * lse**2)
    w = np.ones(E.shape[0]) if o.ce_weight is None else np.array(o.ce_weight)
    t = np.where(live, w[y0], 0.0)
    if o.reduction == "none":
        g = np.ones(len(y)) if go is None else np.asarray(go)
        return float((g * t * loss).sum())
    scale = 1.0 if go is None else float(np.asarray(go))
    if o.reduction == "sum":
        return scale * float((t * loss).sum())
    return scale * float((t * loss).sum() / t.sum()) if t.sum() != 0 else 0.0


#: Central-difference step (tyingspec's own helper perturbs each entry of the array in place).
STEP = 1e-6


def assert_close(name: str, actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """Both an absolute part (at the scale of the whole array) and a relative part per entry."""
    scale = max(1.0, float(np.max(np.abs(expected))) if np.size(expected) else 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


@st.composite
def ce_options(draw: st.DrawFn, V: int) -> CEOptions:
    """Each option on or off, every reduction, weights that may be 0, ignore_index in or out of
    the vocabulary."""
    return CEOptions(
        logit_scale=draw(st.sampled_from([1.0, 0.0625, 1.7])),
        softcap=draw(st.sampled_from([None, 0.7, 3.0, 30.0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.4])),
        lse_square_scale=draw(st.sampled_from([0.0, 1e-3, 0.2])),
        ignore_index=draw(st.sampled_from([-100, -1, V - 1])),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        ce_weight=draw(st.none() | st.tuples(*[st.sampled_from([0.0, 0.5, 1.0, 2.5])] * V)),
    )


@st.composite
def problems(draw: st.DrawFn, max_V: int = 6, max_d: int = 4, max_N: int = 7) -> Problem:
    V = draw(st.integers(1, max_V))
    d = draw(st.integers(1, max_d))
    N = draw(st.integers(1, max_N))
    o = draw(ce_options(V))
    block = draw(st.sampled_from([None, 1, 2, 3]))
    composition = draw(st.sampled_from(["random", "repeats", "all-ignored", "ignored-chunk"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if composition == "repeats":  # one target for every token: its row of dE adds N times
        y = np.full(N, rng.integers(0, V))
    else:
        y = rng.integers(0, V, N)
    if composition == "random":
        y[rng.random(N) < 0.3] = o.ignore_index
    elif composition == "all-ignored":
        y[:] = o.ignore_index
    elif composition == "ignored-chunk":  # a whole block of the blocked loop ignored
        B = block or N
        y[B * (N // B // 2): B * (N // B // 2) + B] = o.ignore_index
    go: np.ndarray | float | None
    if o.reduction == "none":
        go = draw(st.none() | st.just(rng.normal(size=N)))
    else:
        go = draw(st.sampled_from([None, 1.0, -0.3]))
    return Problem(h=rng.normal(size=(N, d)), E=rng.normal(size=(V, d)), targets=y,
                   b=rng.normal(size=V) if draw(st.booleans()) else None, options=o, go=go,
                   block_rows=block)


def _corner(V: int, N: int, d: int, seed: int, **kw: object) -> Problem:
    rng = np.random.default_rng(seed)
    o = CEOptions(**kw)  # type: ignore[arg-type]
    y = rng.integers(0, V, N)
    y[::3] = o.ignore_index
    go = rng.normal(size=N) if o.reduction == "none" else None
    return Problem(h=rng.normal(size=(N, d)), E=rng.normal(size=(V, d)), targets=y,
                   b=rng.normal(size=V), options=o, go=go, block_rows=2)


# Always run: every option at once under each reduction, and V = 1.
CORNERS = [
    _corner(5, 7, 3, 1, logit_scale=0.0625, softcap=3.0, label_smoothing=0.1,
            lse_square_scale=0.2, reduction=r, ce_weight=(0.5, 1.0, 2.5, 0.0, 1.0))
    for r in REDUCTIONS
] + [_corner(1, 4, 2, 2, label_smoothing=0.4, lse_square_scale=0.2, reduction="mean")]


def corners(test: Callable[..., None]) -> Callable[..., None]:
    for p in CORNERS:
        test = example(p)(test)
    return test


@corners
@given(problems())
def test_closed_form_equals_central_differences_of_the_contract(p: Problem) -> None:
    note(f"options: {p.options.describe()}; targets {p.targets.tolist()}; block {p.block_rows}")
    ref = p.closed()
    h, E = p.h.copy(), p.E.copy()
    b = None if p.b is None else p.b.copy()

    def f() -> float:
        return contract_objective(h, E, p.targets, b, p.options, p.go)

    assert_close("dh", ref.dh, _central(f, h, STEP), 1e-6)
    assert_close("dE", ref.dE, _central(f, E, STEP), 1e-6)
    if b is not None:
        assert ref.db is not None
        assert_close("db", ref.db, _central(f, b, STEP), 1e-6)
    else:
        assert ref.db is None
    # the forward too: the contract's loss (for none, each token's L_i via one-hot go)
    if p.options.reduction == "none":
        for i in range(len(p.targets)):
            onehot = np.eye(len(p.targets))[i]
            want = contract_objective(h, E, p.targets, b, p.options, onehot)
            assert_close(f"L_{i}", np.asarray(ref.loss)[i], np.asarray(want), 1e-12)
    else:
        want = contract_objective(h, E, p.targets, b, p.options, None)
        assert_close("loss", np.asarray(ref.loss), np.asarray(want), 1e-12)
    # dz is what multiplies h and E
    assert_close("dz -> dE", ref.dE, ref.dz.T @ p.h, 1e-12)
    assert_close("dz -> dh", ref.dh, ref.dz @ p.E, 1e-12)


# Shapes the sympy derivation compiles in well under a second each (cached per worker).
SYMBOLIC_SHAPES = [(1, 3), (3, 2), (4, 3)]  # (V, d)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("bias,softcap", list(itertools.product([False, True], [None, 2.5])))
def test_closed_form_equals_sympy_for_every_option_combination(bias: bool,
                                                               softcap: float | None) -> None:
    """Every reduction x every on/off combination of the other options x three shapes."""
    rng = np.random.default_rng(7)
    flags = list(itertools.product([False, True], repeat=5))
    for (V, d), reduction, (scaled, smooth, zloss, weighted, ignored) in itertools.product(
            SYMBOLIC_SHAPES, REDUCTIONS, flags):
        N = 5
        o = CEOptions(logit_scale=0.0625 if scaled else 1.0, softcap=softcap,
                      label_smoothing=0.2 if smooth else 0.0,
                      lse_square_scale=0.3 if zloss else 0.0, reduction=reduction,
                      ce_weight=tuple(rng.uniform(0.2, 3.0, V).tolist()) if weighted else None)
        y = rng.integers(0, V, N)
        y[1] = y[3]  # a repeated target
        if ignored:
            y[0] = y[4] = o.ignore_index
        go = rng.normal(size=N) if reduction == "none" else 0.75
        h, E = 2 * rng.normal(size=(N, d)), 2 * rng.normal(size=(V, d))
        b = rng.normal(size=V) if bias else None
        label = f"V={V} d={d} {o.describe()} bias={bias}"
        sym = symbolic_linear_ce(h, E, y, b, o, go)
        ref = linear_ce(h, E, y, b, o, go)
        assert_close(f"loss {label}", np.asarray(ref.loss), np.asarray(sym.loss), 1e-12)
        assert_close(f"dh {label}", ref.dh, sym.dh, 1e-12)
        assert_close(f"dE {label}", ref.dE, sym.dE, 1e-12)
        if bias:
            assert ref.db is not None and sym.db is not None
            assert_close(f"db {label}", ref.db, sym.db, 1e-12)


@pytest.mark.parametrize("options", [
    CEOptions(),
    CEOptions(logit_scale=0.0625, label_smoothing=0.1),
    CEOptions(softcap=5e3, lse_square_scale=1e-4, reduction="sum"),
    CEOptions(label_smoothing=0.2, lse_square_scale=1e-4, reduction="none",
              ce_weight=tuple(np.linspace(0.5, 2.0, 50))),
], ids=lambda o: o.describe())
@pytest.mark.parametrize("spread", ["wide", "shifted"])
def test_float32_at_logits_of_1e4_is_finite_and_within_float32_rounding(
        options: CEOptions, spread: str) -> None:
    """|logit| ~ 1e4 after the scale: spread wide (a saturated softmax) or all shifted by 1e4
    through the bias (a spread-out softmax, where only the max shift keeps exp finite)."""
    V, d, N = 50, 8, 24
    rng = np.random.default_rng(3)
    s = options.logit_scale
    if spread == "wide":
        h = (rng.normal(size=(N, d)) * 100 / s).astype(np.float32)
        E = (rng.normal(size=(V, d)) * 30).astype(np.float32)
        b = (rng.normal(size=V) * 100).astype(np.float32)
    else:
        h = rng.normal(size=(N, d)).astype(np.float32)
        E = rng.normal(size=(V, d)).astype(np.float32)
        b = ((1e4 + rng.normal(size=V)) / s).astype(np.float32)
    y = rng.integers(0, V, N)
    y[[2, 5, 11]] = options.ignore_index
    go = rng.normal(size=N).astype(np.float32) if options.reduction == "none" else None
    # both from the same float32 inputs: only the arithmetic differs
    lo = linear_ce(h, E, y, b, options, go, dtype="float32")
    hi = linear_ce(h, E, y, b, options, go, dtype="float64")
    for name in ("dh", "dE", "db", "dz"):
        arr = getattr(lo, name)
        assert arr.dtype == np.float32, name
        assert np.all(np.isfinite(arr)), name
    assert np.all(np.isfinite(lo.loss))
    logit = abs(options.logit_scale) * (
        float((np.abs(h).astype(np.float64) @ np.abs(E).T.astype(np.float64)).max())
        + float(np.abs(b).max()))
    assert logit > 5e3  # the regime under test
    # Higham: a logit is a d-term dot product, off by ~ d u |logit|; the softmax passes that on
    # as a relative error of g; the reductions over N and V add their lengths.
    k = d + N + np.sqrt(V) + d * logit
    for name, got, want, rows in (("dE", lo.dE, hi.dE, hi.dE_terms),
                                  ("dh", lo.dh, hi.dh, hi.dh_terms)):
        tol = row_tolerance(Terms(rows=rows, k=k), "float32")
        ok = tol.close(got.astype(np.float64), want)
        assert ok.all(), f"{name}: {np.argwhere(~ok)[:5].tolist()} outside {tol.describe()}"
    terms = Terms(rows=hi.dE_terms, k=k)
    tol = value_tolerance(terms, "float32", np.abs(hi.dz).sum(axis=0))
    assert lo.db is not None and hi.db is not None
    assert tol.close(lo.db.astype(np.float64), hi.db).all()
    lse_size = logit * (1 + options.lse_square_scale * logit)
    tol = value_tolerance(terms, "float32", 3 * lse_size)
    assert np.all(tol.close(np.asarray(lo.loss, np.float64), np.asarray(hi.loss)))


@pytest.mark.parametrize("variant", [None, *VARIANTS])
@pytest.mark.parametrize("weights", [None, (0.0, 0.0, 1.0)])
def test_all_ignored_mean_is_zero_loss_and_zero_gradients(variant: str | None,
                                                          weights: tuple[float, ...] | None,
                                                          ) -> None:
    """Every token ignored (or only classes of weight 0 present): sum t_i = 0, the defined 0."""
    rng = np.random.default_rng(5)
    o = CEOptions(label_smoothing=0.1, lse_square_scale=0.1, ce_weight=weights)
    y = np.array([-100, 0, -100, 1]) if weights else np.full(4, -100)
    p = Problem(h=rng.normal(size=(4, 2)), E=rng.normal(size=(3, 2)), targets=y,
                b=rng.normal(size=3), options=o, block_rows=2)
    for r in (p.closed(variant), symbolic_linear_ce(p.h, p.E, y, p.b, o)):
        assert r.loss == 0.0
        assert r.db is not None
        for g in (r.dh, r.dE, r.db):
            assert not np.any(g)


def test_blocking_changes_only_rounding_and_ignored_targets_may_be_out_of_range() -> None:
    rng = np.random.default_rng(9)
    y = np.array([3, -100, -100, 1, 3, 0, -100])
    base = Problem(h=rng.normal(size=(7, 3)), E=rng.normal(size=(4, 3)), targets=y,
                   b=None, options=CEOptions(label_smoothing=0.1, reduction="none"),
                   go=rng.normal(size=7))
    whole = base.closed()
    for block in (1, 2, 3):
        part = replace(base, block_rows=block).closed()
        assert_close(f"dE block {block}", part.dE, whole.dE, 1e-14)
        assert_close(f"loss block {block}", np.asarray(part.loss), np.asarray(whole.loss), 1e-14)
    assert np.asarray(whole.loss)[[1, 2, 6]].tolist() == [0.0, 0.0, 0.0]
    assert not np.any(whole.dz[[1, 2, 6]])
    with pytest.raises(ValueError, match="outside"):
        linear_ce(base.h, base.E, np.array([4, 0, 0, 0, 0, 0, 0]), None, CEOptions())


# variant -> (options where the bug shows, options where it cannot).  Every case has ignored
# tokens and a non-constant grad_output unless the "cannot" side removes them.
_ALL = CEOptions(logit_scale=0.0625, softcap=2.0, label_smoothing=0.2, lse_square_scale=0.2)
VARIANT_CASES: dict[str, tuple[CEOptions, CEOptions]] = {
    "scale_dropped": (_ALL, replace(_ALL, logit_scale=1.0)),
    "scale_twice": (replace(_ALL, logit_scale=1.7), replace(_ALL, logit_scale=1.0)),
    "softcap_derivative_missing": (_ALL, replace(_ALL, softcap=None)),
    "smoothing_misweighted": (_ALL, replace(_ALL, label_smoothing=0.0)),
    "z_loss_missing": (_ALL, replace(_ALL, lse_square_scale=0.0)),
    "ignored_counted": (_ALL, replace(_ALL, reduction="sum")),
    "ignored_not_zeroed": (_ALL, replace(_ALL, reduction="none")),  # + no ignored tokens below
    "grad_output_first": (replace(_ALL, reduction="none"), _ALL),
}
LOSS_CHANGES = {"ignored_counted"}


def _variant_problem(o: CEOptions, ignored: bool = True) -> Problem:
    rng = np.random.default_rng(11)
    N, V, d = 6, 5, 3
    y = np.array([0, 2, 2, 4, 1, 3])
    if ignored:
        y[[1, 4]] = o.ignore_index
    go = rng.normal(size=N) if o.reduction == "none" else None
    # logits of a few units at s = 0.0625: the softcap at 2 bends them
    return Problem(h=rng.normal(size=(N, d)) * 6, E=rng.normal(size=(V, d)) * 6, targets=y,
                   b=rng.normal(size=V), options=o, go=go, block_rows=4)


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.max(np.abs(a - b)) > 1e-3 * max(1e-12, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_differs_where_its_bug_matters_and_only_there(variant: str) -> None:
    assert set(VARIANT_CASES) == set(VARIANTS)
    matters, harmless = VARIANT_CASES[variant]
    p = _variant_problem(matters)
    right, wrong = p.closed(), p.closed(variant)
    assert _differs(wrong.dE, right.dE) and _differs(wrong.dh, right.dh), variant
    assert wrong.db is not None and right.db is not None
    if variant in LOSS_CHANGES:
        assert _differs(np.asarray(wrong.loss), np.asarray(right.loss))
    else:
        np.testing.assert_array_equal(wrong.loss, right.loss)
    q = _variant_problem(harmless, ignored=variant != "ignored_not_zeroed")
    right, wrong = q.closed(), q.closed(variant)
    for name in ("dh", "dE", "db", "dz"):
        np.testing.assert_allclose(getattr(wrong, name), getattr(right, name), rtol=1e-15,
                                   atol=1e-15, err_msg=f"{variant} {name}")
    np.testing.assert_allclose(wrong.loss, right.loss, rtol=1e-15)


def test_scale_variants_are_the_right_gradient_off_by_the_scale() -> None:
    """unsloth-zoo PR #930: a 0.0625 scale dropped from the backward is a 16x tied gradient."""
    p = _variant_problem(replace(_ALL, logit_scale=0.0625))
    right = p.closed()
    np.testing.assert_allclose(p.closed("scale_dropped").dE, 16 * right.dE, rtol=1e-12)
    np.testing.assert_allclose(p.closed("scale_twice").dE, right.dE / 16, rtol=1e-12)


def test_options_describe_themselves() -> None:
    assert CEOptions().describe() == "defaults" and CEOptions().nondefault() == {}
    o = CEOptions(softcap=30.0, reduction="sum", ce_weight=(1.0, 2.0))
    assert o.nondefault() == {"softcap": 30.0, "reduction": "sum", "ce_weight": (1.0, 2.0)}
    assert o.describe() == "softcap=30.0 reduction=sum ce_weight[2]"
    with pytest.raises(ValueError, match="reduction"):
        CEOptions(reduction="avg")
    assert all(len(v) == 2 and v[0] and v[1] for v in VARIANTS.values())


@pytest.mark.parametrize("variant", [None, *VARIANTS])
def test_a_factored_dE_and_its_projections_are_the_dense_ones(variant: str | None) -> None:
    """What a check at a large shape keeps instead of the [V, d] dE: its factors (read a block
    of rows at a time) and its projections onto directions Z, whose magnitudes bound the
    projected |dE| (the sketch's allowance rests on that bound)."""
    o = _ALL if variant is None else VARIANT_CASES[variant][0]
    p = _variant_problem(o)
    Z = np.random.default_rng(5).normal(size=(3, 4))
    dense = linear_ce(p.h, p.E, p.targets, p.b, o, p.go, variant=variant, block_rows=4)
    fac = linear_ce(p.h, p.E, p.targets, p.b, o, p.go, variant=variant, block_rows=4, Z=Z,
                    factored=True)
    assert isinstance(fac.dE, OutputPath) and isinstance(dense.dE, np.ndarray)
    assert dense.projected is None and fac.projected is not None
    assert_close("dE", np.asarray(fac.dE), dense.dE, 1e-13)
    assert_close("rows 1..3", row_block(fac.dE, 1, 4), dense.dE[1:4], 1e-13)
    proj, mag = fac.projected
    assert_close("dE @ Z", proj, dense.dE @ Z, 1e-12)
    assert np.all(np.abs(dense.dE) @ np.abs(Z) <= mag * (1 + 1e-12) + 1e-300)
    for name in ("dh", "dz", "dE_terms", "dh_terms"):
        np.testing.assert_array_equal(getattr(fac, name), getattr(dense, name), err_msg=name)
