"""Judging absent rows through projections (``core.paths.Sketch``) at large shapes.

The sketch is what makes a check at GPT-2 size affordable; these tests force it on small
shapes, where the dense judgement is cheap, and hold it to the same verdicts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from builtin_verdicts import labels
from builtin_verdicts import names as builtin_names
from hypothesis import given, settings
from hypothesis import strategies as st

from tyingspec._src.core import paths as _probe
from tyingspec._src.core.cases import at_shape, build, kernel_paths, standard_cases
from tyingspec._src.core.diagnosis import diagnose
from tyingspec._src.core.paths import (
    InputPath,
    OutputPath,
    closed_form_paths,
    forward_parts,
    scatter_rows,
    sketch_directions,
)
from tyingspec._src.core.tolerance import row_tolerance


def _paths(seed: int = 0, *, V: int = 96, d: int = 12, N: int = 16, sketch: bool = True,
           dtype: str = "float64") -> tuple[object, _probe.Paths]:
    case = next(c for c in standard_cases(seed) if c.name == "absent-tokens")
    case = replace(at_shape([case], V, d, N)[0][0], dtype=dtype)
    b = build(case)
    return b, closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in,
                                sketch=sketch)


def test_factored_paths_equal_the_dense_ones() -> None:
    _, dense = _paths(sketch=False)
    _, sk = _paths(sketch=True)
    assert isinstance(sk.dE_in, InputPath) and isinstance(sk.dE_out, OutputPath)
    assert sk.sketch is not None and dense.sketch is None
    np.testing.assert_array_equal(np.asarray(sk.dE_in), dense.dE_in)
    np.testing.assert_allclose(np.asarray(sk.dE_out), dense.dE_out, rtol=1e-12, atol=1e-15)
    rows = np.array([0, 5, int(sk.tokens[0]), 95])
    np.testing.assert_array_equal(sk.in_rows(rows), dense.dE_in[rows])
    np.testing.assert_allclose(sk.out_rows(rows), dense.dE_out[rows], rtol=1e-12, atol=1e-15)


def test_a_float32_factored_row_is_the_dense_float32_row() -> None:
    # rows of the output path are computed as the dense reference computes them, in the
    # factors' dtype (its rounding is what the bound counts), and handed over in float64
    _, dense = _paths(sketch=False, dtype="float32", V=300, d=24, N=64)
    _, sk = _paths(sketch=True, dtype="float32", V=300, d=24, N=64)
    assert isinstance(sk.dE_out, OutputPath) and sk.dE_out.g.dtype == np.float32
    rows = np.array([0, 7, int(sk.tokens[0]), 299])
    got = sk.out_rows(rows)
    assert got.dtype == np.float64
    g, h = sk.dE_out.g.astype(np.float64), sk.dE_out.h.astype(np.float64)
    exact = g[:, rows].T @ h
    # each entry is a sum over N positions: float32 rounding of at most N u sum |g| |h|
    bound = 64 * 2.0**-24 * (np.abs(g[:, rows]).T @ np.abs(h))
    np.testing.assert_array_less(np.abs(got - exact), bound + np.finfo(np.float64).tiny)
    np.testing.assert_array_less(np.abs(got - dense.dE_out[rows].astype(np.float64)),
                                 2 * bound + np.finfo(np.float64).tiny)


def test_input_path_adds_repeated_tokens_like_add_at() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 7, size=40)
    # small integers: every sum is exact in float32 whatever the order of the additions
    rows = rng.integers(-50, 50, size=(40, 5)).astype(np.float32)
    expected = np.zeros((9, 5), dtype=np.float32)
    np.add.at(expected, tokens, rows)
    np.testing.assert_array_equal(scatter_rows(tokens, rows, 9), expected)
    np.testing.assert_array_equal(np.asarray(InputPath(tokens, rows, 9)), expected)
    np.testing.assert_array_equal(InputPath(tokens, rows, 9).rows(np.array([8, 0, 3])),
                                  expected[[8, 0, 3]].astype(np.float64))


def test_directions_are_drawn_from_the_batch() -> None:
    t, y = np.array([3, 1, 4]), np.array([1, 5, 9])
    Z1, cols, s1 = sketch_directions(t, y, 6)
    # every column sampled when d <= 24: their unit vectors first, then the Gaussian ones
    assert np.array_equal(cols, np.arange(6))
    assert np.array_equal(Z1[:, :6], np.eye(6)) and Z1.shape == (6, 6 + 8)
    Z2, _, s2 = sketch_directions(t.copy(), y.copy(), 6)
    Z3, _, s3 = sketch_directions(t, np.array([1, 5, 8]), 6)
    assert s1 == s2 and np.array_equal(Z1, Z2)
    assert s1 != s3 and not np.array_equal(Z1, Z3)


def test_the_reference_passes_its_own_sketch_with_the_rows_counted() -> None:
    b, paths = _paths()
    diag = diagnose(np.asarray(paths.dE_in) + np.asarray(paths.dE_out), paths)
    assert diag.label == "correct"
    assert diag.rows_projected == 96 - len(np.union1d(b.tokens, b.targets))  # type: ignore[attr-defined]
    assert diag.as_dict()["rows_projected"] == diag.rows_projected


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), share=st.floats(0.0, 1.0))
def test_a_row_within_its_entrywise_bound_is_within_every_projected_one(seed: int,
                                                                       share: float) -> None:
    """Soundness: the projected allowance is the entrywise one summed, so any error the dense
    judgement accepts, the sketch accepts too."""
    _, paths = _paths(seed % 1000)
    ref = np.asarray(paths.dE_in) + np.asarray(paths.dE_out)
    tol = row_tolerance(paths.bound_terms, "float64")
    allow = tol.atol + tol.rtol * np.abs(ref)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=ref.shape)
    # every entry near its limit (0.9: the addition itself rounds by up to half an ulp)
    actual = ref + share * 0.9 * allow * signs
    assert diagnose(actual, replace(paths, sketch=None)).label == "correct"
    assert diagnose(actual, paths).label == "correct"


@pytest.mark.parametrize("d", [12, 64])  # every column sampled / 24 of 64
@pytest.mark.parametrize("relative", [1e-3, 0.5])
def test_one_wrong_absent_row_is_found_and_named(relative: float, d: int) -> None:
    b, paths = _paths(d=d)
    ref = np.asarray(paths.dE_in) + np.asarray(paths.dE_out)
    absent = int(np.setdiff1d(np.arange(96), np.union1d(b.tokens, b.targets))[0])  # type: ignore[attr-defined]
    actual = ref.copy()
    actual[absent] *= 1 + relative
    diag = diagnose(actual, paths)
    assert diag.rows_projected > 0
    assert diag.wrong_rows == [absent]
    assert diag.label == "output_path_wrong"


def test_an_error_in_one_unsampled_entry_is_seen_by_the_gaussian_directions() -> None:
    b, paths = _paths(d=64)
    assert paths.sketch is not None
    unsampled = int(np.setdiff1d(np.arange(64), paths.sketch.columns)[0])
    ref = np.asarray(paths.dE_in) + np.asarray(paths.dE_out)
    absent = int(np.setdiff1d(np.arange(96), paths.sketch.exact)[0])
    actual = ref.copy()
    actual[absent, unsampled] += 10 * np.abs(ref[absent]).sum()  # large against the row's sum
    diag = diagnose(actual, paths)
    assert diag.wrong_rows == [absent]


def test_kernel_reference_sketches_too() -> None:
    b, _ = _paths(sketch=False)
    p = forward_parts(b.E, b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)  # type: ignore[attr-defined]
    sk = kernel_paths(b.tokens, p.input_rows, p.h, p.g, 96, sketch=True)  # type: ignore[attr-defined]
    dense = kernel_paths(b.tokens, p.input_rows, p.h, p.g, 96, sketch=False)  # type: ignore[attr-defined]
    assert sk.sketch is not None and dense.sketch is None
    right = dense.dE
    assert diagnose(right, sk).label == "correct"
    assert diagnose(np.asarray(dense.dE_out), sk).label == "input_path_missing"


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("kind", ["model", "kernel"])
def test_every_builtin_gets_the_same_verdict_sketched(kind: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every correct built-in passes and every broken one fails with the same label, case by
    case, whether absent rows are compared entry by entry or through projections."""
    names = builtin_names(kind)
    assert len(names) > 10
    dense = {n: labels(kind, n) for n in names}
    monkeypatch.setattr(_probe, "SKETCH_ABOVE", -1)
    sketched = {n: labels(kind, n) for n in names}
    assert sketched == dense
    # the sketch was in force, and the zoo's broken ones were caught through it
    assert any(status == "wrong" for rows in sketched.values() for _, status, _, _ in rows)
