"""Each property holds for every correct implementation and catches the mutant it targets,
naming it; every mutant fingerprint holds for its mutant and fails for a correct
implementation; the strategies draw every composition they promise; properties import from an
installed tyingspec."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import UnsatisfiedAssumption
from tyingspec.properties import PROPERTIES, PropertyFailure, for_kind
from tyingspec.properties._signatures import SIGNATURES, SignatureMismatch

from tyingspec import LABELS, REGISTRY, Case, build
from tyingspec._src.core.cases import COMPOSITIONS
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Target, load, observe
from tyingspec._src.front.kill_matrix import KILLED, run_property
from tyingspec._src.kinds.probe.mutants import reset_state
from tyingspec._src.kinds.table import KINDS

PROPERTIES_DIR = Path(__file__).resolve().parents[2] / "properties"

EXPECTED_PROPERTIES = [
    "sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
    "relabelling_permutes_rows", "micro_batches_accumulate", "loss_dW_db_right",
    "inputs_untouched", "same_call_same_gradient", "tie_survives_a_step", "linear_in_dx",
    "linear_in_g",
]
CORRECT = sorted(n for n, impl in REGISTRY.items() if impl.correct)
# (property, kind, correct implementation): every applicable combination, a static list.
_ALL_PASSING = [(p, k, n) for p in EXPECTED_PROPERTIES for k in ("model", "kernel")
                for n in CORRECT if k in PROPERTIES[p].kinds and REGISTRY[n].adapter(k) is not None]


def _default_passing() -> set[tuple[str, str, str]]:
    """Each (property, kind) with one correct style, the styles taken in turn so that every
    style runs: the default tier's share of the cross product (the slow tier runs it all)."""
    pairs = list(dict.fromkeys((p, k) for p, k, _ in _ALL_PASSING))
    styles = {pair: [n for p, k, n in _ALL_PASSING if (p, k) == pair] for pair in pairs}
    return {(*pair, styles[pair][i % len(styles[pair])]) for i, pair in enumerate(pairs)}


DEFAULT_PASSING = _default_passing()
PASSING = [c if c in DEFAULT_PASSING else pytest.param(*c, marks=pytest.mark.slow)
           for c in _ALL_PASSING]

# The mutant each property is built to catch, and the diagnosis its failure must carry.
TARGETS: list[tuple[str, str, str, set[str]]] = [
    ("sum_of_paths", "model", "output-path-only", {"input_path_missing"}),
    ("sum_of_paths", "kernel", "input-path-only", {"output_path_missing"}),
    ("absent_rows_are_output_path", "model", "input-path-only", {"output_path_missing"}),
    ("absent_rows_are_output_path", "kernel", "logit-scale-dropped", {"path_scaled"}),
    ("repeated_tokens_accumulate", "model", "duplicates-buffered",
     {"duplicates_not_accumulated"}),
    ("repeated_tokens_accumulate", "kernel", "duplicates-first-only",
     {"duplicates_not_accumulated"}),
    ("relabelling_permutes_rows", "model", "padding-row-masked",
     {"input_path_missing", "input_path_wrong"}),
    ("relabelling_permutes_rows", "kernel", "padding-row-masked",
     {"input_path_missing", "input_path_wrong"}),
    ("micro_batches_accumulate", "model", "input-path-sum-not-mean", {"path_scaled"}),
    ("micro_batches_accumulate", "kernel", "duplicates-last-only",
     {"duplicates_not_accumulated"}),
    ("loss_dW_db_right", "model", "db-sum-not-mean", {"other_gradient_wrong"}),
    ("inputs_untouched", "model", "sorts-tokens-in-place", {"inputs_mutated"}),
    ("inputs_untouched", "kernel", "sorts-tokens-in-place", {"inputs_mutated"}),
    # the second identical call is judged on its own: twice the gradient, both paths x2
    ("same_call_same_gradient", "model", "grad-not-zeroed", {"gradient_not_zeroed"}),
    ("same_call_same_gradient", "kernel", "grad-not-zeroed", {"gradient_not_zeroed"}),
    # the engine names a copied tie after the step (its untied gradient fits there)
    ("tie_survives_a_step", "model", "copy-tie", {"tie_is_a_copy"}),
    ("linear_in_dx", "kernel", "grad-not-zeroed", set(LABELS)),
    ("linear_in_g", "kernel", "grad-not-zeroed", set(LABELS)),
]


TORCH_PROPERTIES = ["torch_tie_identity", "torch_optimizer_sees_tie_once",
                    "torch_gradient_by_path", "torch_gradient_against_forward",
                    "torch_fresh_gradient", "torch_micro_batches_accumulate"]
LINEAR_CE_PROPERTIES = ["ce_kernel_outputs", "ce_tie_is_the_sum_of_paths"]


def test_every_property_is_registered_with_a_statement_and_its_kinds() -> None:
    # the probe kinds' properties first, then each other kind's own (a user's own module, a
    # kernel of another contract: nothing of the probe contract applies to them)
    own = {p: k for k in KINDS if k not in ("model", "kernel") for p in KINDS[k].properties}
    assert list(PROPERTIES)[:len(EXPECTED_PROPERTIES)] == EXPECTED_PROPERTIES
    assert set(PROPERTIES) == set(EXPECTED_PROPERTIES) | set(own)
    assert list(KINDS["torch"].properties) == TORCH_PROPERTIES
    assert list(KINDS["linear-ce"].properties) == LINEAR_CE_PROPERTIES
    for prop in PROPERTIES.values():
        assert len(prop.doc) > 40, prop.name
        if prop.name in own:
            assert prop.kinds == (own[prop.name],), prop.name
        else:
            assert set(prop.kinds) <= {"model", "kernel"} and prop.kinds
        assert prop.invariant.isupper()
    assert {p for p in PROPERTIES if PROPERTIES[p].kinds == ("kernel",)} == {"linear_in_dx",
                                                                           "linear_in_g"}
    assert {p for p in PROPERTIES if PROPERTIES[p].kinds == ("model",)} == {"loss_dW_db_right",
                                                                          "tie_survives_a_step"}


def test_the_kind_table_lists_registered_properties_once_each() -> None:
    # Property.kinds is derived from the table: a name the table lists but nothing registers (a
    # typo, a renamed property) would silently never run, so check the table against PROPERTIES.
    for kind, table in KINDS.items():
        assert len(set(table.properties)) == len(table.properties), kind
        assert set(table.properties) <= set(PROPERTIES), set(table.properties) - set(PROPERTIES)
        assert [p.name for p in for_kind(kind)] == list(table.properties)
    assert {p for t in KINDS.values() for p in t.properties} == set(PROPERTIES)


def test_the_default_tier_runs_every_property_kind_and_correct_style() -> None:
    assert {(p, k) for p, k, _ in DEFAULT_PASSING} == {(p, k) for p, k, _ in _ALL_PASSING}
    assert {n for _, _, n in DEFAULT_PASSING} == set(CORRECT)


@pytest.mark.parametrize("prop,kind,name", PASSING, ids=lambda v: str(v))
def test_property_holds_for_a_correct_implementation(prop: str, kind: str, name: str) -> None:
    p = PROPERTIES[prop]
    target = load(name, kind)

    @given(p.strategy())
    def check(case: Case) -> None:
        p.check(target, case)

    check()


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("prop,kind,mutant,labels", TARGETS,
                         ids=[f"{p}-{k}-{m}" for p, k, m, _ in TARGETS])
def test_property_catches_its_target_mutant_with_the_right_diagnosis(
        prop: str, kind: str, mutant: str, labels: set[str]) -> None:
    cell = run_property(PROPERTIES[prop], REGISTRY[mutant], kind, max_examples=40)
    assert cell.status == KILLED, cell
    assert cell.label in labels, cell.message
    assert cell.case is not None and cell.case.tokens is not None  # the batch, spelled out
    assert f"property {prop} does not hold" in cell.message
    assert f"tokens={list(cell.case.tokens)}" in cell.message


def test_a_failure_message_puts_the_diagnosis_first_then_the_rows_then_the_batch() -> None:
    case = Case("m", V=12, d=3, N=4, seed=5, composition="distinct")
    with pytest.raises(PropertyFailure) as info:
        PROPERTIES["sum_of_paths"].check(load("output-path-only", "model"), case)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("property sum_of_paths does not hold")
    assert lines[1].startswith("diagnosis: input_path_missing: input path missing")
    assert lines[2].startswith("rows: 4 wrong, 8 of 12 (66.7%) exactly right; wrong rows [")
    assert lines.index("batch:") > 2
    assert lines[-2].strip().startswith("V=12 d=3 N=4")
    assert lines[-1].strip().startswith("composition=distinct tokens=[")
    assert info.value.label == "input_path_missing"


def test_rows_that_are_the_models_own_are_not_reported_as_compared() -> None:
    # A kind that cannot observe a use of the tie (a detached lookup) judges its own gradient,
    # split as its backward split it: "0 wrong, all exactly right" and "power: input path NO"
    # would describe a comparison with itself beside a forward check that found rows wrong.
    from dataclasses import replace

    from tyingspec._src.core.findings import failed, uses_unobserved
    from tyingspec._src.core.render import diagnosis_lines

    obs = observe(load("tied", "model"), Case("m", V=12, d=3, N=4, seed=5))
    compared = diagnosis_lines(obs.diagnosis, indent="")
    assert compared[1].startswith("rows: 0 wrong, 12 of 12 exactly right")
    assert any(line.startswith("power: ") for line in compared)
    own = replace(obs.diagnosis, label="input_path_missing", findings=(
        uses_unobserved("a use of the tied weight cannot be observed (a detached lookup)"),
        failed("gradient against the forward", "agrees with the loss", "input_path_missing",
               "rows [1, 2] disagree with the forward")))
    lines = diagnosis_lines(own, indent="")
    rows = [line for line in lines if line.startswith("rows: ")]
    assert rows == ["rows: not compared with a reference: a use of the tied weight cannot be "
                    "observed, so the rows are the model's own (gradient by path: n/a); the "
                    "gradient against the forward judges them"]
    assert not any(line.startswith(("power: ", "judged at ")) for line in lines)
    assert any("FAIL gradient against the forward" in line for line in lines)
    # a correct case's one line of numbers says the same
    from tyingspec._src.front.check import CaseResult
    from tyingspec._src.front.report import render_case

    passed = replace(obs.diagnosis, findings=own.findings[:1])
    shown = render_case(CaseResult(obs.case, "correct", passed))
    assert shown[1:] == ["  " + rows[0], "  n/a  gradient by path [" + passed.findings[0].invariant
                         + "]: " + passed.findings[0].detail]
    assert render_case(CaseResult(obs.case, "correct", obs.diagnosis))[1].startswith(
        "  power: input path yes")


def test_absent_rows_property_lets_a_dropped_input_path_pass_as_it_should() -> None:
    # Dropping the input path leaves every absent row exact: this property alone cannot see it.
    cell = run_property(PROPERTIES["absent_rows_are_output_path"], REGISTRY["output-path-only"],
                        "model", max_examples=40)
    assert cell.status == "survived"


def test_an_example_without_power_is_discarded_not_counted() -> None:
    vacuous = Case("zero-E", V=8, d=3, N=5, seed=2, e_scale=0.0)
    for name in ("sum_of_paths", "absent_rows_are_output_path", "micro_batches_accumulate"):
        with pytest.raises(UnsatisfiedAssumption):
            PROPERTIES[name].check(load("output-path-only", "model"), vacuous)
    with pytest.raises(UnsatisfiedAssumption):  # V = 1: g = 0, both paths vanish
        PROPERTIES["sum_of_paths"].check(load("input-path-only", "kernel"),
                                         Case("v1", V=1, d=2, N=3, seed=0))


def test_a_float32_implementation_is_judged_at_float32_and_float64_one_at_float64() -> None:
    case64 = Case("f", V=10, d=4, N=6, seed=3, composition="repeats", distinct=3)
    # float32 end to end on float64 inputs: judged at float32 by the dtype it returns
    PROPERTIES["sum_of_paths"].check(load("tied-float32", "model"), case64)

    tied = REGISTRY["tied"].model
    assert tied is not None

    def rounded(*a, **k):  # type: ignore[no-untyped-def]
        out = dict(tied(*a, **k))
        out["dE"] = out["dE"] * (1 + 1e-6)  # float32-sized error, claimed as float64
        return out

    with pytest.raises(PropertyFailure) as info:
        PROPERTIES["sum_of_paths"].check(Target("rounded", KINDS["model"], rounded), case64)
    # within the float32 bound, beyond the float64 one it claims: named for what it is
    assert info.value.label == "precision_limited", info.value


def test_dropped_input_path_is_caught_on_every_drawn_float32_batch_with_power() -> None:
    prop = PROPERTIES["sum_of_paths"]
    target = load("output-path-only", "model")
    seen = Counter[str]()

    @settings(suppress_health_check=list(HealthCheck))
    @given(cases(dtypes=("float32",)))
    def check(case: Case) -> None:
        try:
            prop.check(target, case)
        except PropertyFailure as exc:
            seen[exc.label] += 1
            return
        except UnsatisfiedAssumption:
            raise
        raise AssertionError(f"passed at float32: {case}")

    check()
    assert set(seen) == {"input_path_missing"}


# --- mutant fingerprints ------------------------------------------------------------------------

# One batch on which every fingerprint has something to show: token 0 present (padding mask),
# tokens 0 and 3 repeated (duplicates), rows absent (output path alone), unsorted tokens (an
# in-place sort), s_in != 1 and res not in {0, 1} (factors and the block's input and output
# differ), a bias and N > 1 (db x N).
FINGERPRINT_CASE = Case("fingerprint", V=12, d=3, N=8, seed=11, res=0.6, s_in=1.7,
                        tokens=(0, 5, 3, 0, 7, 3, 1, 0), targets=(4, 0, 9, 3, 11, 2, 6, 5))
FINGERPRINT_ROWS = [(name, kind) for name, sig in SIGNATURES.items() for kind in sig.kinds]


@pytest.mark.parametrize("name,kind", FINGERPRINT_ROWS,
                         ids=[f"{n}-{k}" for n, k in FINGERPRINT_ROWS])
def test_a_fingerprint_holds_for_its_mutant_and_fails_for_a_correct_implementation(
        name: str, kind: str) -> None:
    # The Hypothesis run of each fingerprint (tests/front/test_mutants.py) only shows it holds; this
    # shows it can fail: the correct implementation of the same kind does not have it.
    sig = SIGNATURES[name]
    mutant = load(name, kind)
    # this batch has power for every bug: the engine's verdict is the zoo entry's label (the
    # stateful ones on their second call, hence the reset)
    reset_state()
    assert observe(mutant, FINGERPRINT_CASE).label == REGISTRY[name].expected
    sig.check(mutant, FINGERPRINT_CASE)
    # again: a stateful fingerprint resets what it needs, whatever the last run left behind
    sig.check(mutant, FINGERPRINT_CASE)
    with pytest.raises(SignatureMismatch) as info:
        sig.check(load("tied", kind), FINGERPRINT_CASE)
    assert info.value.mutant == name
    assert "tokens=[0, 5, 3, 0, 7, 3, 1, 0]" in str(info.value)  # the batch, as it replays


def test_the_stateful_fingerprints_catch_the_bug_only_from_the_second_call() -> None:
    # Each stateful mutant's first call is right, so a fingerprint of its first call alone
    # would pass a correct implementation too: the second call is what tells them apart.
    for name, problem in (("grad-not-zeroed", "first call's dE plus the reference"),
                          ("copy-tie", "not the untied gradient")):
        with pytest.raises(SignatureMismatch, match=problem):
            SIGNATURES[name].check(load("tied", "model"), FINGERPRINT_CASE)
    # a mutant that is wrong from its first call is not a stateful one
    with pytest.raises(SignatureMismatch, match="first call after a reset is wrong"):
        SIGNATURES["grad-not-zeroed"].check(load("output-path-only", "model"),
                                            FINGERPRINT_CASE)


# --- strategies ---------------------------------------------------------------------------------

@given(cases())
def test_drawn_cases_build_and_keep_their_composition_promises(case: Case) -> None:
    b = build(case)
    t = b.tokens
    assert t.shape == (case.N,) and 0 <= t.min() and t.max() < case.V
    assert b.E.dtype == np.dtype(case.dtype)
    uniq, counts = np.unique(t, return_counts=True)
    if case.composition == "distinct":
        assert counts.max() == 1
    elif case.composition == "one-token":
        assert uniq.size == 1 and case.N >= 2
    elif case.composition == "repeats":
        assert counts.max() >= 2
    elif case.composition == "multiplicity":
        assert case.multiplicity is not None and set(counts) <= {1, case.multiplicity}
        assert (counts == case.multiplicity).sum() == case.N // case.multiplicity
    elif case.composition == "sparse":
        assert uniq.size <= case.V // 4, "most of the vocabulary must be absent"
    elif case.composition == "crowded":
        assert case.N > case.V
    elif case.composition == "with-zero":
        assert 0 in t
    elif case.composition == "no-zero":
        assert 0 not in t
    if case.e_scale == 0.0:
        assert not b.E.any()


def test_the_strategy_draws_every_composition_shape_and_setting_it_promises() -> None:
    # A quality test of the distribution (like the kill matrix): it needs a fixed, derandomized
    # number of draws, so it pins its own settings instead of following the profile.
    seen: dict[str, set[object]] = {k: set() for k in
                                    ("composition", "res", "s_in", "bias", "dtype", "square",
                                     "e_scale", "v1")}

    @settings(max_examples=400, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(cases())
    def draw(case: Case) -> None:
        seen["composition"].add(case.composition)
        seen["res"].add(case.res)
        seen["s_in"].add(case.s_in)
        seen["bias"].add(case.bias)
        seen["dtype"].add(case.dtype)
        seen["square"].add(case.V == case.d)
        seen["e_scale"].add(case.e_scale)
        seen["v1"].add(case.V == 1)

    draw()
    assert seen["composition"] == set(COMPOSITIONS)
    assert seen["res"] == {0.0, 1.0, 0.6} and seen["s_in"] == {1.0, 1.7, 0.4}
    assert seen["bias"] == {True, False} and seen["dtype"] == {"float64", "float32"}
    assert seen["square"] == {True, False} and seen["e_scale"] == {0.0, 1.0}
    assert seen["v1"] == {True, False}


def test_strategy_bounds_are_honoured_and_impossible_compositions_are_refused() -> None:
    @settings(max_examples=100, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(cases(max_vocab=6, max_width=3, max_len=5, min_len=2, min_vocab=2, degenerate=False))
    def bounded(case: Case) -> None:
        assert 2 <= case.V <= 6 and 1 <= case.d <= 3 and 2 <= case.N <= 5
        assert case.composition != "sparse" and case.e_scale == 1.0

    bounded()
    with pytest.raises(ValueError, match="no composition"):
        cases(max_vocab=4, compositions=("sparse",))
    with pytest.raises(ValueError, match="unknown compositions"):
        cases(compositions=("shuffled",))


def test_shrinking_ends_at_a_small_readable_batch() -> None:
    cell = run_property(PROPERTIES["sum_of_paths"], REGISTRY["duplicates-buffered"], "model",
                        max_examples=60)
    assert cell.case is not None and cell.case.tokens is not None
    assert cell.case.N <= 3 and cell.case.V <= 4 and cell.case.d <= 2, cell.case
    assert len(set(cell.case.tokens)) < cell.case.N  # still a repeated token: the bug's trigger


# --- packaging ----------------------------------------------------------------------------------

def test_property_modules_import_tyingspec_never_the_repository_layout() -> None:
    for path in sorted(PROPERTIES_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("properties"), path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("properties") for a in node.names), path.name


def test_properties_import_as_tyingspec_properties_from_any_directory(tmp_path: Path) -> None:
    code = ("import tyingspec.properties as p, tyingspec; "
            "assert 'sum_of_paths' in p.PROPERTIES and len(p.PROPERTIES) >= 11; "
            "print(p.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "tyingspec.properties"


def test_a_failure_shrinks_to_a_small_readable_batch_under_the_plugins_settings() -> None:
    """Regression: Hypothesis' explain phase reported a variation (V=8 d=8 N=20), not the
    shrunk minimum; the plugin's settings leave it out."""
    from hypothesis import given, settings
    from tyingspec.properties import PROPERTIES, PropertyFailure

    from tyingspec._src.front.suite import profile_settings

    prop = PROPERTIES["sum_of_paths"]
    target = load("output-path-only", "model")
    chosen = settings(profile_settings("dev"), database=None)  # no replay of a saved minimum
    test = chosen(given(case=prop.strategy())(lambda case: prop.check(target, case)))
    with pytest.raises(PropertyFailure) as info:
        test()
    case = info.value.case
    assert (case.V, case.d, case.N) == (2, 1, 1), case.describe()
