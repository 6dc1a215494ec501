"""How a diagnosis reads on a terminal: lines wrapped to its width (a row list or code never
cut), no storage addresses, row lists with their counts, no replay line where nothing failed."""

from __future__ import annotations

import re

import pytest

from tyingspec._src.core import render as render_module
from tyingspec._src.core.render import no_addresses, rows_text, terminal_width, wrapped
from tyingspec._src.front.cli import main
from tyingspec._src.front.results import EXIT_NO_POWER


@pytest.mark.parametrize("text, expected", [
    ("lm_head.weight and wte.weight are two Parameters (equal values, storages 0x7f3a10 and "
     "0x7f3b20) where a tie is expected", "lm_head.weight and wte.weight are two Parameters "
     "(equal values) where a tie is expected"),
    ("two Parameters (storages 0x1a and 0x2b)", "two Parameters"),
    ("two Parameters over one storage (0x7f3a10): each gets", "two Parameters over one "
     "storage: each gets"),
    ("different values (storages 0xa and 0xb) where", "different values where"),
])
def test_no_storage_address_is_shown(text: str, expected: str) -> None:
    assert no_addresses(text) == expected


def test_row_lists_carry_their_counts() -> None:
    assert rows_text([3, 7, 9], total=64) == "[3, 7, 9] (3 of 64)"
    assert rows_text(range(20), limit=4, total=64) == "[0, 1, 2, 3, ...] (20 of 64)"
    assert rows_text(range(20), limit=4) == "[0, 1, 2, 3, ... (20 rows)]"


def test_lines_are_wrapped_to_the_width_and_row_lists_never_cut() -> None:
    rows = rows_text(range(12), total=32)
    line = "  rows: 12 wrong; wrong rows " + rows + " and then a long tail of words " * 4
    out = wrapped([line], 50)
    assert len(out) > 1 and all(len(x) <= 50 for x in out if rows not in x)
    assert sum(rows in x for x in out) == 1  # the row list whole, on one line
    assert all(x.startswith("      ") for x in out[1:])  # continuation hangs past the indent
    assert " ".join(x.strip() for x in out) == line.strip()
    assert wrapped([line], None) == [line]  # a pipe: left whole


def test_a_pipe_is_not_wrapped(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    assert terminal_width(sys.stdout) is None  # pytest's capture is no terminal


def test_a_terminal_check_is_wrapped_and_its_replay_left_whole(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_module, "terminal_width", lambda stream=None: 60)
    assert main(["check", "output-path-only", "--case", "absent-tokens", "-q"]) == 1
    out = capsys.readouterr().out.splitlines()
    case = out[1:out.index(next(x for x in out if x.startswith("verdict:")))]
    whole = [x for x in case if x.lstrip().startswith(("replay:", "smallest failing batch"))]
    # to be copied, never broken
    assert [x.split(":")[0].strip() for x in whole] == ["smallest failing batch", "replay"]
    assert whole[-1].endswith("--case absent-tokens" + whole[-1].split("absent-tokens")[1])
    assert re.search(r"--tokens \S+ --targets \S+$", whole[-1])
    assert all(len(x) <= 60 for x in case if x not in whole and not re.search(r"\[[\d, .]+\]", x))


def test_a_no_power_case_has_no_replay_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "tied", "--case", "v-equals-1", "-q"]) == EXIT_NO_POWER
    out = capsys.readouterr().out
    assert "NO POWER" in out and "replay:" not in out
