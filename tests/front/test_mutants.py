"""The mutant zoo: every mutant is killed (mutation score 100%), every correct implementation
passes every property, and every mutant shows its own fingerprint on Hypothesis-drawn batches."""

from __future__ import annotations

import json
import re
from argparse import ArgumentParser
from pathlib import Path

import pytest
from hypothesis import given
from tyingspec.properties import PROPERTIES
from tyingspec.properties._signatures import SIGNATURES, SignatureMismatch, missing_signatures

from tyingspec import LABELS, REGISTRY, Case, Implementation, load
from tyingspec._src.front.kill_matrix import (
    FAILED,
    KILLED,
    PASSED,
    SURVIVED,
    configure_parser,
    kill_matrix,
    render,
    run,
    run_row,
    targets,
)
from tyingspec._src.kinds.probe.builtins import mutants, styles
from tyingspec._src.kinds.probe.mutants import MUTANT, STATEFUL, STYLE, reset_state

# The kill matrix pins its own Hypothesis budget (bounded, derandomized): it is a measurement of
# the suite's power, not a test the profile should scale.  Rows are static, so xdist workers
# collect the same tests in the same order.
MATRIX_EXAMPLES = 25
SHARED = ("model", "kernel")  # the registry's kinds; torch and linear-ce have their own zoos
MUTANT_ROWS = [(impl.name, kind) for impl, kind in targets(SHARED) if not impl.correct]
STYLE_ROWS = [(impl.name, kind) for impl, kind in targets(SHARED) if impl.correct]
OWN_ROWS = targets(("torch", "linear-ce"))
#: A torch observation builds and checks a real module: fewer examples bound the slow tier.
OWN_EXAMPLES = {"torch": 12, "linear-ce": MATRIX_EXAMPLES}
SIGNATURE_ROWS = [(name, kind) for name, sig in SIGNATURES.items() for kind in sig.kinds]
# The zoo must cover the bug classes of NOTES.md section 2 that the probe model can express.
ZOO = {
    "output-path-only", "input-path-only", "output-path-overwritten", "paths-averaged",
    "input-path-doubled", "duplicates-buffered", "duplicates-first-only",
    "duplicates-last-only", "s-in-missing-in-backward", "output-path-from-x",
    "logit-scale-dropped", "input-path-sum-not-mean", "copy-tie", "padding-row-masked",
    "grad-not-zeroed", "sorts-tokens-in-place", "db-sum-not-mean",
}
STYLES = {"tied", "untied-sum", "tied-bincount", "tied-one-hot", "tied-sorted-segments",
          "tied-float32"}


def _ids(rows: list[tuple[str, str]]) -> list[str]:
    return [f"{name}-{kind}" for name, kind in rows]


def test_the_zoo_covers_the_catalogue_and_every_entry_says_what_it_breaks() -> None:
    assert {m.name for m in mutants()} == ZOO
    assert {s.name for s in styles()} == STYLES
    for impl in mutants():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", impl.name), impl.name
        assert impl.breaks and impl.expected in LABELS and impl.expected != "correct", impl.name
        assert impl.model is not None, f"{impl.name}: every mutant has a model form"
        assert "builtin" in impl.tags or MUTANT in impl.tags
    for impl in styles():
        assert impl.expected == "correct" and ("builtin" in impl.tags or STYLE in impl.tags)
    assert {m.name for m in mutants() if STATEFUL in m.tags} == {"copy-tie", "grad-not-zeroed"}


def test_every_mutant_has_a_fingerprint() -> None:
    assert missing_signatures() == []
    assert set(SIGNATURES) == ZOO


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", MUTANT_ROWS, ids=_ids(MUTANT_ROWS))
def test_mutant_is_killed_by_some_property_with_its_registry_label(name: str, kind: str) -> None:
    row = run_row(REGISTRY[name], kind, max_examples=MATRIX_EXAMPLES)
    assert row.label == REGISTRY[name].expected, (row.label, REGISTRY[name].expected)
    assert row.killed_by, f"{name} ({kind}) survived every property: " + ", ".join(
        f"{p}: {c.status} ({c.examples} examples)" for p, c in row.cells.items())
    assert all(c.status in (KILLED, SURVIVED) for c in row.cells.values()), row.cells
    small = row.smallest()
    assert small is not None and small.case is not None and small.case.tokens is not None
    assert small.case.N <= 4, f"shrinking should end at a small batch: {small.case}"


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", STYLE_ROWS, ids=_ids(STYLE_ROWS))
def test_correct_style_passes_every_property(name: str, kind: str) -> None:
    row = run_row(REGISTRY[name], kind, max_examples=MATRIX_EXAMPLES)
    failures = {p: c.message for p, c in row.cells.items() if c.status != PASSED}
    assert not failures, failures
    assert set(row.cells) == {p.name for p in PROPERTIES.values() if kind in p.kinds}


@pytest.mark.slow
@pytest.mark.parametrize("impl,kind", OWN_ROWS,
                         ids=[f"{impl.name}-{kind}" for impl, kind in OWN_ROWS])
def test_the_kind_zoos_are_killed_and_their_correct_models_pass(impl: Implementation,
                                                               kind: str) -> None:
    row = run_row(impl, kind, max_examples=OWN_EXAMPLES[kind])
    assert row.label == impl.expected, (row.label, impl.expected)
    if impl.correct:
        assert all(c.status == PASSED for c in row.cells.values()), row.cells
    else:
        assert row.killed_by, f"{impl.name} ({kind}) survived every property"
        assert {c.label for c in row.cells.values() if c.failed} & {impl.expected}, row.cells


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name,kind", SIGNATURE_ROWS, ids=_ids(SIGNATURE_ROWS))
def test_mutant_shows_its_fingerprint_on_drawn_batches(name: str, kind: str) -> None:
    sig = SIGNATURES[name]
    target = load(name, kind)
    reset_state()

    @given(sig.strategy())
    def fingerprint(case: Case) -> None:
        sig.check(target, case)

    fingerprint()


# Draws random Hypothesis seeds found (2026-12-03), each a fingerprint the check above once
# refused: (mutant, case, why).
DRAWN_FAILURES = [
    ("logit-scale-dropped",
     Case(name="drawn-random", V=2, d=2, N=1, seed=1, composition="random", bias=True,
          dtype="float64"),
     "dE_in + 16 dE_out carries 16x the output path's rounding: the factor's fit was refused"),
    ("output-path-from-x",
     Case(name="drawn-random", V=29, d=1, N=2, seed=969899, composition="random", res=0.6,
          bias=False, dtype="float32"),
     "at d = 1, g.T @ x is 1.87064 g.T @ h within the bound: the diagnosis's one factor fits "
     "every row, least squares over both factors does not"),
    ("s-in-missing-in-backward",
     Case(name="drawn-one-token", V=24, d=2, N=4, seed=8101, composition="one-token", res=0.0,
          s_in=1.7, bias=False, dtype="float32"),
     "one token four times at d = 2: its input path / 1.7 is also two of its four occurrences "
     "within the float32 bound, and the diagnosis names that (duplicates)"),
]


@pytest.mark.parametrize("name,case,why", DRAWN_FAILURES, ids=[f[0] for f in DRAWN_FAILURES])
def test_fingerprints_once_refused_on_drawn_batches_hold(name: str, case: Case, why: str) -> None:
    reset_state()
    try:
        SIGNATURES[name].check(load(name, "model"), case)
    except SignatureMismatch as exc:
        pytest.fail(f"{why}: {exc}")


def test_the_matrix_scores_a_surviving_mutant_below_100_percent_and_exits_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    # A "mutant" that is in fact correct survives every property: CI must fail on it.
    tied = REGISTRY["tied"]
    fake = Implementation("fake-mutant", "claims a bug it does not have", "SUM",
                          "input_path_missing", model=tied.model, kernel=tied.kernel,
                          tags=(MUTANT,))
    monkeypatch.setitem(REGISTRY, "fake-mutant", fake)
    report = kill_matrix(kinds=("kernel",), max_examples=5,
                         names=["fake-mutant", "output-path-only", "tied-one-hot"])
    assert report.killed == 1 and len(report.mutants) == 2 and report.score == 0.5
    assert report.styles_pass and not report.ok
    text = render(report)
    assert "mutation score: 1/2 = 50.0%" in text and "SURVIVED" in text
    assert "fake-mutant (kernel): survived every property" in text

    parser = ArgumentParser()
    configure_parser(parser)
    out = tmp_path / "m.json"
    code = run(parser.parse_args(["--kind", "kernel", "--max-examples", "5", "--only",
                                  "fake-mutant", "--json", str(out)]))
    assert code == 1
    data = json.loads(out.read_text())
    assert data["schema"] == "tyingspec.mutants/1" and data["score"] == 0.0 and not data["ok"]
    assert "NOT OK" in capsys.readouterr().out


def test_the_matrix_report_is_builtin_types_and_names_the_smallest_killing_batch(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    parser = ArgumentParser()
    configure_parser(parser)
    out = tmp_path / "m.json"
    # --full: the cell below is not the row's first kill; --jobs 1: no pool for two rows
    code = run(parser.parse_args(["--kind", "model", "--max-examples", "10", "--only",
                                  "duplicates-buffered", "--only", "tied", "--json", str(out),
                                  "--full", "--jobs", "1"]))
    text = capsys.readouterr().out
    assert code == 0 and "mutation score: 1/1 = 100.0%" in text
    assert "OK: every mutant killed, every correct implementation passes" in text
    data = json.loads(out.read_text())  # json.loads proves builtin types throughout
    (row,) = data["mutants"]
    assert row["name"] == "duplicates-buffered" and row["ok"]
    batch = row["smallest"]["batch"]
    assert len(batch["tokens"]) == batch["N"] and len(set(batch["tokens"])) < batch["N"]
    assert row["cells"]["repeated_tokens_accumulate"]["status"] == KILLED
    assert row["cells"]["repeated_tokens_accumulate"]["label"] == "duplicates_not_accumulated"
    assert data["styles"][0]["cells"]["sum_of_paths"]["status"] == PASSED


def test_options_are_validated_by_the_parser() -> None:
    parser = ArgumentParser()
    configure_parser(parser)
    for bad in (["--max-examples", "0"], ["--seed", "-1"], ["--only", "no-such-mutant"],
                ["--kind", "both"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_seed_replaces_derandomized_runs_and_still_kills() -> None:
    row = run_row(REGISTRY["duplicates-first-only"], "kernel", max_examples=15, seed=3,
                  properties=["repeated_tokens_accumulate"])
    assert row.cells["repeated_tokens_accumulate"].status == KILLED
    assert FAILED not in {c.status for c in row.cells.values()}
