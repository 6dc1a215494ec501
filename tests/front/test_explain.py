"""``tyingspec explain LABEL``: every label's row of the README's table, and a minimal example
(a built-in's command that reaches it, or the lines of code that make it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tyingspec._src.core.labels import LABELS
from tyingspec._src.front.cli import main
from tyingspec._src.front.explain import TABLE, examples, markdown

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_table_is_the_readmes() -> None:
    rows = markdown().splitlines()
    assert [r for r in rows if r not in README] == []
    assert set(TABLE) == {str(label) for label in LABELS} | {"n/a"}


@pytest.mark.parametrize("label", sorted(TABLE))
def test_explain_prints_the_row_and_a_minimal_example(
        label: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", label]) == 0
    out = capsys.readouterr().out
    meaning, where = TABLE[label]
    # printed to a pipe: left whole, so each cell is there as the README has it
    assert f"  what it means: {meaning}\n" in out
    assert f"  what to look at in your code: {where}\n" in out
    if label == "n/a":
        return
    code = out.split("\n  to see it:\n", 1)[-1] if "\n  to see it:\n" in out else \
        out.split("a minimal example:\n", 1)[1]
    shown = [line.strip() for line in code.splitlines() if line.startswith("    ")]
    assert shown, out
    for name, kind, flags in examples(label):
        assert f"tyingspec check {name} --kind {kind}" + (f" {flags}" if flags else "") in shown


@pytest.mark.parametrize("label", ["input_path_missing", "duplicates_not_accumulated",
                                   "no_power"])
def test_the_example_command_shows_the_label(label: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    name, kind, flags = next(e for e in examples(label) if e[1] == "model")
    main(["check", name, "--kind", kind, *flags.split(), "-q"])
    assert f"verdict: {'wrong (' + label + ')' if label != 'no_power' else 'no_power'}" \
        in capsys.readouterr().out


def test_an_unknown_label_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "no_such_label"]) == 2
    assert "no label 'no_such_label'" in capsys.readouterr().err


def test_explain_lists_every_label(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {label} " in out for label in TABLE)
