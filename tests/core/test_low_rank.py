"""E at production shapes (``core.cases._drawn_low_rank``): a part of rank ``E_RANK`` plus one
entry a row, of full rank, and the reference's products through its factors
(``core.paths.LowRank``).

Production shapes are slow to test, so most of these force the low-rank draw on small shapes
(``LOW_RANK_ABOVE``, ``LOW_RANK_FROM`` and ``E_RANK`` lowered) and hold it to what a dense E
gives; one builds a real one at the smallest shape that draws it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from builtin_verdicts import labels
from builtin_verdicts import names as builtin_names

from tyingspec._src.core import cases as _cases
from tyingspec._src.core import paths as _paths
from tyingspec._src.core.cases import (
    at_shape,
    build,
    closed_form,
    e_rank,
    released,
    sgd_step,
    standard_cases,
)
from tyingspec._src.core.paths import LowRank, forward_parts
from tyingspec._src.core.tolerance import numpy_dtype

#: The smallest shape the defaults draw low-rank: 2**22 entries, 256 columns.
V_PROD, D_PROD = 16384, 256


def _case(V: int, d: int, N: int, dtype: str = "float32", seed: int = 0,
          name: str = "absent-tokens") -> _cases.Case:
    case = next(c for c in standard_cases(seed) if c.name == name)
    return replace(at_shape([case], V, d, N)[0][0], dtype=dtype)


def _small_low_rank(monkeypatch: pytest.MonkeyPatch, rank: int = 4) -> None:
    """Every probe case from 8 rows and columns up draws E of ``rank``."""
    monkeypatch.setattr(_cases, "LOW_RANK_ABOVE", 1)
    monkeypatch.setattr(_cases, "LOW_RANK_FROM", 8)
    monkeypatch.setattr(_cases, "E_RANK", rank)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_production_shape_draws_E_exactly_as_its_factors(dtype: str) -> None:
    case = _case(V_PROD, D_PROD, 64, dtype)
    assert e_rank(case) == _cases.E_RANK
    b = build(case)
    f = b.e_factors()
    assert f is not None and f.rank == _cases.E_RANK and f.spikes is not None
    assert b.E.dtype == numpy_dtype(dtype)  # type: ignore[arg-type]
    for factor in (f.A, f.B, f.spikes):
        assert np.array_equal(factor, np.round(factor))
    assert np.abs(f.A).max() <= 255 and np.abs(f.B).max() <= 255
    # every entry of A @ B + S is an integer float32 holds exactly
    assert (np.abs(f.A) @ np.abs(f.B)).max() + np.abs(f.spikes).max() < 2**24
    assert float(np.log2(f.scale)).is_integer()
    # exact: the float64 matrix of the factors is E, bit for bit, in E's own dtype
    assert np.array_equal(f.dense().astype(b.E.dtype), b.E)
    assert np.array_equal(f.dense(), b.E.astype(np.float64))
    # E's spread is the case's, as a dense draw's is, a quarter of its variance on S
    np.testing.assert_allclose(float(b.E.std()), case.e_scale, rtol=0.02, atol=0.0)
    rows = np.arange(b.E.shape[0])
    spike_var = float((f.spikes * f.scale).var()) / D_PROD
    np.testing.assert_allclose(spike_var, _cases.SPIKE_SHARE * case.e_scale**2, rtol=0.05)
    # and E is of full rank: any 2 d of its rows span all of d (the low-rank part alone, 32)
    assert np.linalg.matrix_rank(b.E[:2 * D_PROD].astype(np.float64)) == D_PROD
    assert np.linalg.matrix_rank((f.A @ f.B)[:2 * D_PROD]) == _cases.E_RANK
    # S's entry of row v is at column v % d
    S = f.dense() / f.scale - f.A @ f.B
    assert np.array_equal(S[rows, rows % D_PROD], f.spikes)
    S[rows, rows % D_PROD] = 0
    assert not S.any()


def test_the_rest_of_the_batch_is_the_one_a_dense_E_draws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(V_PROD, D_PROD, 64)
    low = build(case)
    monkeypatch.setattr(_cases, "LOW_RANK_FROM", 10**9)
    dense = build(case)
    assert dense.e_factors() is None and low.e_factors() is not None
    assert not np.array_equal(dense.E, low.E)
    for name in ("W", "b", "tokens", "targets"):
        assert np.array_equal(getattr(dense, name), getattr(low, name)), name


@pytest.mark.parametrize("shape, dtype", [((V_PROD, D_PROD), "bfloat16"),
                                          ((V_PROD, D_PROD), "float16"),
                                          ((V_PROD // 2, D_PROD), "float32"),
                                          ((V_PROD, D_PROD // 2), "float32"),
                                          ((96, 12), "float64")])
def test_other_shapes_and_dtypes_draw_a_dense_E(shape: tuple[int, int], dtype: str) -> None:
    # bfloat16 and float16 cannot hold the factors' product exactly; the others are too small
    case = _case(*shape, 8, dtype)
    assert e_rank(case) is None
    assert build(case).e_factors() is None


def test_a_shrunk_case_keeps_its_E() -> None:
    """The rank depends on the shape, never on N: shrinking a case keeps the E it failed on."""
    case = _case(V_PROD, D_PROD, 64)
    b = build(case)
    short = case.with_batch(b.tokens[:3], b.targets[:3])
    assert e_rank(short) == e_rank(case)
    assert np.array_equal(build(short).E, b.E)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_factored_products_are_the_dense_ones(dtype: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Both products through the factors against float64 dense ones: within one rounding of
    the output dtype (they are computed in float64 and rounded once), a block boundary
    crossed (``_LOW_RANK_ROWS`` lowered)."""
    _small_low_rank(monkeypatch)
    monkeypatch.setattr(_paths, "_LOW_RANK_ROWS", 5)
    b = build(_case(160, 12, 24, dtype))
    f = b.e_factors()
    assert f is not None
    E64 = b.E.astype(np.float64)
    h = np.random.default_rng(1).standard_normal((24, 12)).astype(b.E.dtype)
    g = np.random.default_rng(2).standard_normal((24, 160)).astype(b.E.dtype)
    eps = float(np.finfo(b.E.dtype).eps)
    logits, dh = f.times_rows_T(h, b.E.dtype), f.times(g)
    assert logits.dtype == b.E.dtype and dh.dtype == b.E.dtype
    for got, want, terms in ((logits, h.astype(np.float64) @ E64.T, np.abs(h) @ np.abs(E64.T)),
                             (dh, g.astype(np.float64) @ E64, np.abs(g) @ np.abs(E64))):
        np.testing.assert_allclose(got, want, rtol=eps, atol=1e-12 * float(terms.max()))


def test_the_reference_goes_through_the_factors_and_agrees_with_a_dense_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _small_low_rank(monkeypatch)
    b = build(_case(160, 12, 24, "float64"))
    assert b.e_factors() is not None
    used: list[int] = []
    times_rows_T = LowRank.times_rows_T
    monkeypatch.setattr(LowRank, "times_rows_T",
                        lambda self, h, dt: used.append(1) or times_rows_T(self, h, dt))
    factored = closed_form(b)
    assert used
    dense = closed_form(replace(b, low_rank=None))
    assert len(used) == 1
    np.testing.assert_allclose(factored.dE, dense.dE, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(factored.loss, dense.loss, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(factored.dW, dense.dW, rtol=1e-12, atol=1e-15)


def test_an_E_that_is_no_longer_the_drawn_one_is_not_taken_for_its_factors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stepped, released, copied or replaced E is computed from itself: factors held for the
    E drawn would give the reference of another matrix."""
    _small_low_rank(monkeypatch)
    b = build(_case(160, 12, 24))
    assert b.e_factors() is not None
    moved = sgd_step(b, np.ones_like(b.E))
    assert moved is not None and moved[0].e_factors() is None
    assert replace(b, E=b.E.copy()).e_factors() is None
    monkeypatch.setattr(_cases, "RELEASE_ABOVE", 0)
    assert released(b, {}).e_factors() is None
    # and a forward on the stepped E is that E's, not the drawn one's
    s = moved[0]
    p = forward_parts(s.E, s.E, s.W, s.b, s.tokens, s.targets, s.res, s.s_in,
                      out_factors=s.e_factors())
    q = forward_parts(s.E, s.E, s.W, s.b, s.tokens, s.targets, s.res, s.s_in)
    np.testing.assert_array_equal(p.g, q.g)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("kind", ["model", "kernel"])
def test_every_builtin_gets_the_same_verdict_on_a_low_rank_E(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every correct built-in passes and every broken one fails with the same label, case by
    case, on an E of rank 2 in 12 columns (E_RANK's 32 in GPT-2's 768 is far less thin) as on a
    dense one: no bug of the zoo hides in the directions E's rows do not reach."""
    names = builtin_names(kind)
    assert len(names) > 10
    dense = {n: labels(kind, n) for n in names}
    _small_low_rank(monkeypatch, rank=2)
    drawn = build(_case(160, 12, 24))
    f = drawn.e_factors()
    assert f is not None and np.linalg.matrix_rank(f.A @ f.B) == 2
    assert np.linalg.matrix_rank(drawn.E) == 12  # with one entry a row: full rank
    low = {n: labels(kind, n) for n in names}
    assert low == dense
    assert any(status == "wrong" for rows in low.values() for _, status, _, _ in rows)


def test_a_case_says_when_its_E_is_low_rank() -> None:
    assert f"E of rank {_cases.E_RANK}" in _case(V_PROD, D_PROD, 64).describe()
    assert "rank" not in _case(96, 12, 8).describe()
