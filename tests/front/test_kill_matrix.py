"""``tyingspec mutants``'s default matrix: each mutant's row stops at its first kill (the rest
of its properties marked not run), the correct implementations still run every property, and
the rows give the same verdicts and labels as the full matrix (``--full``), in one process or
in several (``--jobs``)."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from pathlib import Path

import pytest
import tyingspec.properties as properties
from tyingspec.properties import for_kind

from tyingspec import REGISTRY
from tyingspec._src.front.kill_matrix import (
    KILLED,
    PASSED,
    SURVIVED,
    PowerReport,
    configure_parser,
    kill_matrix,
    render,
    run,
)

#: Two mutants and a correct implementation of the kernel kind.
NAMES = ["output-path-only", "sorts-tokens-in-place", "tied-one-hot"]
KIND = "kernel"
EXAMPLES = 6


def _verdicts(report: PowerReport) -> dict[str, tuple[bool, str | None]]:
    return {r.name: (r.ok, r.label) for r in report.mutants + report.styles}


def test_the_default_matrix_stops_each_mutant_at_its_first_kill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every mutant of the kind dies to its first property (sum_of_paths); in reverse order,
    # output-path-only survives four properties before one kills it.
    props = [p.name for p in reversed(for_kind(KIND))]
    monkeypatch.setattr(properties, "for_kind", lambda kind: list(reversed(for_kind(kind))))
    report = kill_matrix(kinds=(KIND,), names=NAMES, max_examples=EXAMPLES)
    assert not report.full and report.ok and report.score == 1.0
    some_survived_first = False
    for row in report.mutants:
        assert row.label == REGISTRY[row.name].expected, (row.name, row.label)
        run_ = list(row.cells)
        assert run_ == props[:len(run_)] and row.not_run == props[len(run_):], row.name
        # the last property run killed it, every one before it survived
        assert [c.status for c in row.cells.values()] == [SURVIVED] * (len(run_) - 1) + [KILLED]
        some_survived_first |= len(run_) > 1
    assert some_survived_first  # the test exercises a row that did not stop at once
    (style,) = report.styles
    assert list(style.cells) == props and not style.not_run
    assert all(c.status == PASSED for c in style.cells.values())
    text = render(report)
    assert "each mutant up to its first kill" in text and "- not run" in text
    data = report.as_dict()
    assert data["full"] is False
    assert {r["name"]: r["not_run"] for r in data["mutants"]} == {
        r.name: r.not_run for r in report.mutants}


@pytest.mark.slow
def test_the_full_matrix_runs_every_cell_and_agrees_with_the_default() -> None:
    full = kill_matrix(kinds=(KIND,), names=NAMES, max_examples=EXAMPLES, full=True)
    short = kill_matrix(kinds=(KIND,), names=NAMES, max_examples=EXAMPLES)
    props = [p.name for p in for_kind(KIND)]
    assert full.full and all(list(r.cells) == props and not r.not_run for r in full.mutants)
    assert _verdicts(full) == _verdicts(short)
    for a, b in zip(full.mutants, short.mutants):
        # the cells the default ran are the full matrix's, example for example (derandomized)
        assert {p: (c.status, c.label) for p, c in b.cells.items()} == {
            p: (a.cells[p].status, a.cells[p].label) for p in b.cells}, a.name
        assert a.killed_by[0] == b.killed_by[0]


@pytest.mark.slow
def test_rows_in_processes_are_the_rows_in_one() -> None:
    one = kill_matrix(kinds=(KIND,), names=NAMES, max_examples=EXAMPLES, jobs=1)
    two = kill_matrix(kinds=(KIND,), names=NAMES, max_examples=EXAMPLES, jobs=2)
    assert [r.name for r in two.mutants] == [r.name for r in one.mutants]
    assert [r.as_dict() | {"cells": None} for r in two.mutants + two.styles] == [
        r.as_dict() | {"cells": None} for r in one.mutants + one.styles]
    for a, b in zip(one.mutants + one.styles, two.mutants + two.styles):
        assert {p: c.status for p, c in a.cells.items()} == {
            p: c.status for p, c in b.cells.items()}


def test_full_and_jobs_on_the_command_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args([])
    assert not args.full and args.jobs >= 1
    for bad in (["--jobs", "0"], ["--jobs", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    out = tmp_path / "m.json"
    assert run(parser.parse_args(["--kind", KIND, "--only", "sorts-tokens-in-place",
                                  "--max-examples", str(EXAMPLES), "--full",
                                  "--json", str(out)])) == 0
    data = json.loads(out.read_text())
    assert data["full"] is True and data["mutants"][0]["not_run"] == []
    assert "--full for every cell" not in capsys.readouterr().out
