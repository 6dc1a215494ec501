"""The references agree on every entry: sympy == closed form == central differences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

from tyingspec import (
    Case,
    build,
    central_differences,
    closed_form_paths,
    symbolic_paths,
)

# Shapes the sympy derivation compiles in about a second or less (cached per worker).
SYMBOLIC_SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (3, 3), (4, 2), (5, 2), (4, 3)]


@st.composite
def small_cases(draw: st.DrawFn) -> Case:
    V, d = draw(st.sampled_from(SYMBOLIC_SHAPES))
    composition = draw(st.sampled_from(["random", "repeats", "one-token", "with-zero"]
                                       + (["distinct"] if V >= 2 else [])))
    N = draw(st.integers(1, V if composition == "distinct" else 3 * V + 2))
    return Case(
        name="drawn", V=V, d=d, N=N, seed=draw(st.integers(0, 2**32 - 1)),
        composition=composition,
        res=draw(st.sampled_from([0.0, 1.0, 0.6])),
        s_in=draw(st.sampled_from([1.0, 1.7, 0.4])),
        bias=draw(st.booleans()),
    )


# Always run, whatever Hypothesis draws: the corners the issue names.
CORNERS = [
    Case("V=1", V=1, d=3, N=4, seed=11, res=0.6, s_in=1.7),
    Case("d=1, N>V, repeats", V=3, d=1, N=9, seed=12, composition="repeats", res=0.0),
    Case("absent tokens, no b", V=5, d=2, N=2, seed=13, composition="distinct", bias=False,
         s_in=0.4),
    Case("one token N times", V=4, d=3, N=5, seed=14, composition="one-token"),
]


def corners(test):  # type: ignore[no-untyped-def]
    for case in CORNERS:
        test = example(case)(test)
    return test


def _assert_all_close(name: str, actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    scale = max(1.0, float(np.max(np.abs(expected))) if np.size(expected) else 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=name)


@corners
@given(small_cases())
def test_sympy_equals_closed_form_on_every_entry_of_both_paths(case: Case) -> None:
    note(f"replay: {case}")
    b = build(case)
    sym = symbolic_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    ref = closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    _assert_all_close("dE_in", sym.dE_in, ref.dE_in, 1e-12)
    _assert_all_close("dE_out", sym.dE_out, ref.dE_out, 1e-12)
    _assert_all_close("dW", sym.dW, ref.dW, 1e-12)
    if b.b is not None:
        _assert_all_close("db", sym.db, ref.db, 1e-12)
    _assert_all_close("loss", np.array(sym.loss), np.array(ref.loss), 1e-12)


@corners
@given(small_cases())
def test_tied_reference_equals_central_differences_on_every_entry(case: Case) -> None:
    note(f"replay: {case}")
    b = build(case)
    num = central_differences(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    sym = symbolic_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    ref = closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    for name, a in (("sympy dE", sym.dE_in + sym.dE_out), ("closed-form dE", ref.dE)):
        _assert_all_close(name, a, num.dE, 1e-6)
    _assert_all_close("dW", ref.dW, num.dW, 1e-6)
    if b.b is not None:
        _assert_all_close("db", ref.db, num.db, 1e-6)


@pytest.mark.parametrize("V,d,N", [(64, 16, 40), (7, 1, 30), (1, 5, 3)])
def test_closed_form_equals_central_differences_beyond_symbolic_sizes(V: int, d: int,
                                                                      N: int) -> None:
    b = build(Case("big", V=V, d=d, N=N, seed=V * 1000 + N, composition="repeats",
                   res=0.6, s_in=1.3))
    num = central_differences(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    ref = closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    _assert_all_close("dE", ref.dE, num.dE, 1e-6)


def test_untied_paths_are_the_gradients_of_separate_matrices() -> None:
    """Untying attributes: perturbing only E_out moves the loss by dE_out, only E_in by dE_in."""
    b = build(Case("untie", V=4, d=3, N=9, seed=7, composition="repeats"))
    ref = closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    sym = symbolic_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    from tyingspec import loss_only

    step = 1e-6
    for path, which in (("in", ref.dE_in), ("out", ref.dE_out)):
        num = np.zeros_like(b.E)
        for i in np.ndindex(*b.E.shape):
            up, down = b.E.copy(), b.E.copy()
            up[i] += step
            down[i] -= step
            args = (up, b.E) if path == "in" else (b.E, up)
            args_d = (down, b.E) if path == "in" else (b.E, down)
            num[i] = (loss_only(*args, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
                      - loss_only(*args_d, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
                      ) / (2 * step)
        _assert_all_close(f"dE_{path}", which, num, 1e-6)
    _assert_all_close("sympy dE_in", sym.dE_in, ref.dE_in, 1e-12)


def test_symbolic_reference_refuses_shapes_it_cannot_compile_quickly() -> None:
    b = build(Case("large", V=64, d=16, N=4, seed=0))
    with pytest.raises(ValueError, match="closed-form"):
        symbolic_paths(b.E, b.W, b.b, b.tokens, b.targets)


def _softmax_whole(logits: np.ndarray, b: np.ndarray | None, targets: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's softmax as one pass per step over the whole [N, V] buffer (how it was
    computed before it ran in blocks of rows): the blocked one must give these bits."""
    g = logits.copy()
    n = g.shape[0]
    if b is not None:
        g += b
    g -= g.max(axis=1, keepdims=True)
    rows = np.arange(n)
    at_target = g[rows, targets].copy()
    np.exp(g, out=g)
    z = g.sum(axis=1, keepdims=True)
    g *= (1 / (z * g.dtype.type(n))).astype(g.dtype, copy=False)
    g[rows, targets] -= g.dtype.type(1) / g.dtype.type(n)
    return g, at_target, z[:, 0]


@pytest.mark.parametrize("cores", [1, 2, 3])
@given(n=st.integers(1, 40), V=st.integers(1, 300), bias=st.booleans(),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**32 - 1))
def test_the_blocked_softmax_is_bit_for_bit_the_whole_buffer_one(
        cores: int, n: int, V: int, bias: bool, dtype: str, seed: int) -> None:
    from tyingspec._src.core import paths, threads

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, V)) * 4).astype(dtype)
    b = rng.standard_normal(V).astype(dtype) if bias else None
    targets = rng.integers(V, size=n)
    want = _softmax_whole(logits, b, targets)
    g = logits.copy()
    real_cores, real_size = threads.cores, paths._SOFTMAX_THREADS_ABOVE
    try:  # threads even at these sizes, on as many as the test says
        threads.cores, paths._SOFTMAX_THREADS_ABOVE = (lambda: cores), 0
        at_target, z = paths._softmax_in_place(g, b, targets)
    finally:
        threads.cores, paths._SOFTMAX_THREADS_ABOVE = real_cores, real_size
    for got, ref in zip((g, at_target, z), want):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref)


@given(V=st.integers(1, 300), d=st.integers(1, 40), block=st.integers(1, 64),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**32 - 1))
def test_passes_split_over_the_cores_give_the_same_answer_on_any_number_of_them(
        V: int, d: int, block: int, dtype: str, seed: int) -> None:
    """The SGD step, E's row magnitudes and the sketch's projections run a block of rows at a
    time on every core: on 1, 2 or 3 cores (blocks far smaller than in use, so every run
    splits) each gives the same bits, and the answer a whole-array pass gives (the
    projections, BLAS products whose sums may be ordered by the block, to float64 rounding)."""
    from dataclasses import replace

    from tyingspec._src.core import cases, diagnosis, paths, threads
    from tyingspec._src.core.paths import sketch_directions

    rng = np.random.default_rng(seed)
    E = rng.standard_normal((V, d)).astype(dtype)
    dE = (rng.standard_normal((V, d)) * rng.choice([1e-3, 1.0, 1e3])).astype(dtype)
    batch = build(Case(name="split", V=V, d=d, N=1, seed=0, dtype=dtype))
    batch = replace(batch, E=E)
    Z, columns, _ = sketch_directions(np.arange(3), None, d)
    sketch = paths.Sketch(np.zeros(0, dtype=np.int64), Z, columns, 0, np.zeros((V, 0)),
                          np.zeros((V, 0)))
    real = (threads.cores, cases.STEP_ROWS, paths._ABS_ROWS, diagnosis._PROJECT_ROWS)
    got = []
    try:
        cases.STEP_ROWS = paths._ABS_ROWS = diagnosis._PROJECT_ROWS = block
        for n in (1, 2, 3):
            threads.cores = lambda n=n: n
            moved = cases.sgd_step(batch, dE)
            assert moved is not None
            got.append((moved[0].E, moved[1], *paths._abs_rows(E),
                        diagnosis._projected(dE, sketch)))
    finally:
        threads.cores, cases.STEP_ROWS, paths._ABS_ROWS, diagnosis._PROJECT_ROWS = real
    for other in got[1:]:
        for a, b in zip(got[0], other):
            np.testing.assert_array_equal(a, b)
    E1, lr, row_max, sum_max, projected = got[0]
    peak = float(np.abs(dE).max())
    assert lr == cases.SGD_STEP / peak
    np.testing.assert_array_equal(E1, E - np.asarray(lr, dtype=dtype) * dE)
    np.testing.assert_array_equal(row_max, np.abs(E).max(axis=1))
    assert sum_max == float(np.abs(E).sum(axis=1, dtype=np.float64).max())
    whole = dE.astype(np.float64) @ Z
    scale = np.abs(dE.astype(np.float64)) @ np.abs(Z)
    np.testing.assert_array_equal(projected[:, :columns.shape[0]], whole[:, :columns.shape[0]])
    np.testing.assert_allclose(projected, whole, rtol=0,
                               atol=float(4 * d * np.finfo(np.float64).eps * scale.max()))


@given(n=st.integers(1, 40), V=st.integers(1, 200), d=st.integers(1, 12), bias=st.booleans(),
       sketch=st.booleans(), scale=st.sampled_from([0.1, 1.0, 10.0]),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**32 - 1))
def test_the_bound_terms_from_the_softmax_sign_are_the_abs_ones(
        n: int, V: int, d: int, bias: bool, sketch: bool, scale: float, dtype: str,
        seed: int) -> None:
    """The probe model's g is below zero only at each position's target, so the magnitudes
    are taken as ``left.T @ g`` plus ``-2 min(g, 0)`` there: they are the ``|g|`` sums, the
    projections the same product, each to the rounding of its own sums."""
    from tyingspec._src.core import paths

    rng = np.random.default_rng(seed)
    E = (rng.standard_normal((V, d)) * scale).astype(dtype)
    W = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype)
    b = rng.standard_normal(V).astype(dtype) if bias else None
    tokens, targets = rng.integers(V, size=n), rng.integers(V, size=n)
    p = paths.forward_parts(E, E, W, b, tokens, targets)
    assert (np.delete(p.g.reshape(-1), np.arange(n) * V + targets) >= 0).all()
    Z = paths.sketch_directions(tokens, targets, d)[0] if sketch else None
    e_rows = paths._abs_rows(E)[0].astype(p.g.dtype)
    signed = paths._output_rows(p.g, p.h, targets, e_rows, Z, softmax_g=True)
    whole = paths._output_rows(p.g, p.h, targets, e_rows, Z)
    eps = float(np.finfo(dtype).eps)
    for name, got, want, terms in (("rows", signed[0], whole[0], n), ("db", signed[1], whole[1], n),
                                   ("dh terms", signed[2], whole[2], V)):
        # each is a sum of |terms| >= 0: either order rounds within terms * eps of the sum
        np.testing.assert_allclose(got, want, rtol=4 * terms * eps,
                                   atol=4 * terms * eps * float(np.abs(want).max(initial=0)),
                                   err_msg=name)
    assert (signed[3] is None) == (whole[3] is None) == (not sketch)
    if signed[3] is not None and whole[3] is not None:
        mag = signed[3][1]
        np.testing.assert_allclose(mag, whole[3][1], rtol=4 * n * eps,
                                   atol=4 * n * eps * float(mag.max(initial=0)))
        # the projections: sums of signed terms, within their own magnitudes' rounding
        hz = np.abs(p.h.astype(np.float64) @ Z)
        size = np.abs(p.g.astype(np.float64)).T @ hz
        np.testing.assert_allclose(signed[3][0], whole[3][0], rtol=4 * n * eps,
                                   atol=4 * n * eps * float(size.max(initial=0)))
