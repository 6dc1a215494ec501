"""The diagnosis names each built-in bug, on exactly the rows it touches, and knows its power."""

from __future__ import annotations

import numpy as np
import pytest

from tyingspec import REGISTRY, Case, build, closed_form_paths, diagnose, standard_cases


def _paths(case: Case):  # type: ignore[no-untyped-def]
    b = build(case)
    return b, closed_form_paths(b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)


POWERFUL = [c for c in standard_cases(0) if c.V > 1]


@pytest.mark.parametrize("name", sorted(n for n, i in REGISTRY.items() if "builtin" in i.tags))
@pytest.mark.parametrize("case", POWERFUL, ids=lambda c: c.name)
def test_every_builtin_gets_the_diagnosis_its_registry_entry_expects(name: str, case: Case) -> None:
    impl = REGISTRY[name]
    b, paths = _paths(case)
    out = impl.model(b.E, b.W, b.b, b.tokens, b.targets, res=b.res, s_in=b.s_in)
    diag = diagnose(out["dE"], paths)
    expected = impl.expected
    if impl.expected == "duplicates_not_accumulated" and not diag.repeated_rows:
        expected = "correct"  # without a repeated token this bug is invisible, rightly
    assert diag.label == expected, (case, diag.headline())


@pytest.mark.parametrize("case", POWERFUL, ids=lambda c: c.name)
def test_dropped_input_path_is_wrong_on_exactly_the_present_rows(case: Case) -> None:
    b, paths = _paths(case)
    diag = diagnose(paths.dE_out, paths)
    assert diag.wrong_rows == sorted(set(b.tokens.tolist()))
    assert diag.rows_exact == case.V - len(set(b.tokens.tolist()))


def test_duplicate_bug_names_exactly_the_repeated_rows_and_which_occurrence_survived() -> None:
    case = next(c for c in standard_cases(3) if c.name == "repeated-tokens")
    b, paths = _paths(case)
    out = REGISTRY["duplicates-buffered"].model(b.E, b.W, b.b, b.tokens, b.targets)
    diag = diagnose(out["dE"], paths)
    uniq, counts = np.unique(b.tokens, return_counts=True)
    assert diag.wrong_rows == sorted(int(u) for u, c in zip(uniq, counts) if c > 1)
    assert "last occurrence only" in diag.detail


@pytest.mark.parametrize("a,c,words", [(0.5, 0.5, "averaged"), (2.0, 1.0, "input path doubled"),
                                       (1.0, 0.0625, "output path x0.0625")])
def test_scaled_paths_are_named_with_their_factor(a: float, c: float, words: str) -> None:
    _, paths = _paths(POWERFUL[1])
    diag = diagnose(a * paths.dE_in + c * paths.dE_out, paths)
    assert diag.label == "path_scaled" and words in diag.detail
    assert diag.scales is not None
    np.testing.assert_allclose(diag.scales, (a, c), rtol=1e-9, atol=1e-12)


def test_input_path_overwriting_output_path_on_present_rows_is_named() -> None:
    b, paths = _paths(POWERFUL[0])
    present = np.zeros(b.E.shape[0], bool)
    present[b.tokens] = True
    dE = np.where(present[:, None], paths.dE_in, paths.dE_out)
    assert diagnose(dE, paths).label == "output_path_overwritten"


def test_zero_embedding_makes_the_check_say_no_power_instead_of_correct() -> None:
    b, _ = _paths(POWERFUL[0])
    paths = closed_form_paths(np.zeros_like(b.E), b.W, b.b, b.tokens, b.targets)
    broken = diagnose(paths.dE_out, paths)  # input path dropped, yet indistinguishable
    assert broken.label == "no_power" and broken.power.input_path is False


def test_float32_implementation_is_judged_with_float32_tolerances() -> None:
    _, paths = _paths(POWERFUL[1])
    dE32 = paths.dE.astype(np.float32)
    assert diagnose(dE32, paths).label == "correct"
    assert diagnose(dE32, paths, dtype=np.float64).label != "correct"


def test_row_bound_scales_with_the_precision_and_each_rows_own_arithmetic() -> None:
    from tyingspec._src.core.tolerance import UNIT_ROUNDOFF, row_tolerance

    _, paths = _paths(POWERFUL[1])
    assert paths.terms is not None
    t64 = np.asarray(row_tolerance(paths.terms, "float64").atol).ravel()
    t32 = np.asarray(row_tolerance(paths.terms, "float32").atol).ravel()
    np.testing.assert_allclose(t32 / t64, UNIT_ROUNDOFF["float32"] / UNIT_ROUNDOFF["float64"],
                               rtol=1e-12, atol=0)
    # rows with more arithmetic (larger a_v) get a larger bound: not one flat atol
    order = np.argsort(paths.terms.rows)
    assert t64[order[-1]] > t64[order[0]]
    assert (t64 > 0).all()  # never a bare zero (or 1e-300) allowance


def test_rounding_noise_without_power_is_never_given_a_path_label() -> None:
    case = next(c for c in standard_cases(0) if c.name == "v-equals-1")
    b, paths = _paths(case)
    noisy = paths.dE + 1e-3  # far beyond rounding, on an example where no path shows
    diag = diagnose(noisy, paths)
    assert not diag.power.input_path and not diag.power.output_path
    assert diag.label == "unknown", diag.headline()


def test_a_wrong_dW_with_a_right_dE_is_reported() -> None:
    from tyingspec import compare, tolerance_for  # a flat tolerance is fine for this check

    _, paths = _paths(POWERFUL[1])
    bad = compare("dW", paths.dW * 1.01, paths.dW, tolerance_for("float64", paths.dW))
    diag = diagnose(paths.dE, paths, others=[bad])
    assert diag.label == "other_gradient_wrong" and "dW" in diag.detail


def test_diagnosis_does_not_modify_its_inputs() -> None:
    _, paths = _paths(POWERFUL[1])
    dE = paths.dE_out.copy()
    before = (dE.copy(), paths.dE_in.copy(), paths.dE_out.copy())
    diagnose(dE, paths)
    for a, b in zip(before, (dE, paths.dE_in, paths.dE_out)):
        np.testing.assert_array_equal(a, b)


def test_a_path_scaled_by_k_is_named_with_its_factor_despite_k_times_its_rounding() -> None:
    """The logit-scale-dropped mutant computes dE_in + 16 dE_out, and its output path carries
    16 times its rounding.  On this tiny float64 batch (found by a random Hypothesis draw) that
    rounding alone put one entry 1.3x past the sum's own bound, so the fit of the factor 16 was
    refused and the rows called output_path_wrong: a bound for ``x dE_in + y dE_out`` must
    grow with the larger factor."""
    from tyingspec._src.engine.observe import first_call, load

    case = Case(name="drawn-random", V=2, d=2, N=1, seed=1, composition="random", res=1.0,
                s_in=1.0, bias=True, dtype="float64", probe=True)
    o = first_call(load("logit-scale-dropped", "model"), case)
    assert o.diagnosis.label == "path_scaled", o.diagnosis.headline()
    assert o.diagnosis.scales is not None
    np.testing.assert_allclose(o.diagnosis.scales, (1.0, 16.0), rtol=1e-9, atol=1e-12)


def test_forward_pattern_names_exact_patterns_only_from_a_finished_search() -> None:
    """``forward_pattern``: the torch and jax kinds' names for rows found wrong by the forward
    alone.  A search its budget stopped has confirmed only the rows it went down to first, so
    no pattern of "exactly these rows" is named from them; a missing input path is, since
    autograd shows it."""
    from tyingspec._src.core.diagnosis import forward_pattern

    tokens = np.array([3, 5, 3, 9, 5, 7])  # present {3, 5, 7, 9}, repeated {3, 5}
    V = 16
    assert forward_pattern([3, 5, 7, 9], tokens, V)[0] == "input_path_wrong"
    assert forward_pattern([3, 5], tokens, V)[0] == "duplicates_not_accumulated"
    assert forward_pattern([0], tokens, V, padding_idx=0)[0] == "padding_row_masked"
    assert forward_pattern([3, 12], tokens, V)[0] == "gradient_disagrees_with_forward"
    assert forward_pattern([], tokens, V)[0] == "gradient_disagrees_with_forward"
    for rows, pad in (([3, 5, 7, 9], None), ([3, 5], None), ([0], 0)):
        assert forward_pattern(rows, tokens, V, padding_idx=pad,
                               partial=True)[0] == "gradient_disagrees_with_forward"
    for partial in (False, True):
        assert forward_pattern([3, 9], tokens, V, input_reached=False,
                               partial=partial)[0] == "input_path_missing"


def _head_from_tanh(case: Case) -> tuple[np.ndarray, object]:
    """A newcomer's head bug: the output path built from ``tanh(u)`` instead of ``h``
    (``g.T @ tanh(u)``), with the input path right; and the reference paths."""
    from tyingspec._src.core.paths import forward_parts

    b, paths = _paths(case)
    p = forward_parts(b.E, b.E, b.W, b.b, b.tokens, b.targets, b.res, b.s_in)
    return paths.dE_in + p.g.T @ np.tanh(p.x @ b.W), paths


# V = 3, d = 1, one distinct token: the output path has one degree of freedom, so g.T @ tanh(u)
# is g.T @ h times tanh(u)/h (x0.0949 at seed 0), though three rows are wrong.  The plugin's
# shrinking reached both shapes and called them path_scaled; larger batches of the same bug
# said output_path_wrong.
ONE_DATUM = [Case(name="one-token-d1", V=3, d=1, N=1, seed=0, bias=False),
             Case(name="one-token-twice-d1", V=3, d=1, N=2, seed=0, bias=False,
                  composition="one-token")]


@pytest.mark.parametrize("case", ONE_DATUM, ids=lambda c: c.name)
def test_a_wrong_head_gradient_with_one_degree_of_freedom_is_not_called_a_scale(
        case: Case) -> None:
    dE, paths = _head_from_tanh(case)
    diag = diagnose(dE, paths)
    assert len(set(paths.tokens.tolist())) == 1 and diag.rows_wrong == 3
    assert diag.label == "output_path_wrong", diag.headline()
    assert diag.scales is None


@pytest.mark.parametrize("case", [Case(name="d2", V=3, d=2, N=1, seed=0, bias=False),
                                  Case(name="two-tokens", V=4, d=1, N=2, seed=0, bias=False,
                                       composition="distinct"),
                                  Case(name="larger", V=12, d=4, N=6, seed=3)],
                         ids=lambda c: c.name)
def test_the_same_head_bug_is_output_path_wrong_wherever_the_rows_can_tell(case: Case) -> None:
    dE, paths = _head_from_tanh(case)
    assert diagnose(dE, paths).label == "output_path_wrong", diagnose(dE, paths).headline()


@pytest.mark.parametrize(("case", "a", "c"), [
    (ONE_DATUM[0], 1.0, 16.0),  # one datum, but a simple factor: the logit scale dropped
    (ONE_DATUM[0], 0.7, 0.7),  # both paths alike: the input path's entry is a second datum
    (Case(name="larger", V=12, d=4, N=6, seed=3), 1.0, 0.7),  # enough data to refute 0.7
])
def test_a_scale_the_example_could_have_refuted_is_still_named(case: Case, a: float,
                                                                c: float) -> None:
    _, paths = _paths(case)
    diag = diagnose(a * paths.dE_in + c * paths.dE_out, paths)
    assert diag.label == "path_scaled", diag.headline()
    assert diag.scales is not None
    np.testing.assert_allclose(diag.scales, (a, c), rtol=1e-6, atol=1e-12)
