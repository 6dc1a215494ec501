"""``tyingspec check --html PATH`` (and the plugin's ``--tyingspec-html``): the picture of the
rows is read back from the file, and the rows it draws wrong are exactly the diagnosis' wrong
rows, each row coloured by what the batch did with it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
from conftest import Scratch

from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.front.html import COLOURS, RowProfile, write

SVG = "{http://www.w3.org/2000/svg}"


def _svgs(text: str) -> dict[str, ElementTree.Element]:
    """Each case's SVG in the HTML file, by case name."""
    found = {}
    for m in re.finditer(r'<section class="case" data-case="([^"]+)"[^>]*>(.*?)</section>', text,
                         re.S):
        svg = re.search(r"<svg .*?</svg>", m.group(2), re.S)
        if svg is not None:
            found[m.group(1)] = ElementTree.fromstring(svg.group(0))
    return found


def _rows(svg: ElementTree.Element, group: str, cls: str) -> set[int]:
    """The rows drawn in ``group`` (``rows``, ``error``, ``marks``) whose class has ``cls``."""
    g = next(e for e in svg.iter(f"{SVG}g") if e.get("class") == group)
    out = set()
    for rect in g.iter(f"{SVG}rect"):
        if cls in (rect.get("class") or "").split():
            first, _, last = rect.get("data-rows", "").partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


@pytest.mark.parametrize("mutant", ["duplicates-buffered", "output-path-only"])
def test_the_rows_drawn_wrong_are_the_diagnosis_wrong_rows(tmp_path: Path, mutant: str) -> None:
    report = check_target(mutant, "model", 0, keep_rows=True)
    out = tmp_path / "rows.html"
    write(report, out)
    svgs = _svgs(out.read_text())
    drawn = [r for r in report.results if isinstance(r.rows, RowProfile)]
    assert drawn and set(svgs) == {r.case.name for r in drawn}
    some_wrong = False
    for r in drawn:
        assert r.diagnosis is not None
        svg = svgs[r.case.name]
        wrong = {int(x) for x in r.diagnosis.wrong_rows}
        some_wrong |= bool(wrong)
        assert int(svg.get("data-rows-total", 0)) == r.diagnosis.rows_total
        # marked above the strip, red in the strip's class and in the error track: the same rows
        assert _rows(svg, "marks", "wrong") == wrong, r.case.name
        assert _rows(svg, "rows", "wrong") == wrong, r.case.name
        assert _rows(svg, "error", "wrong") == wrong, r.case.name
        # each wrong row's bar stands above the bound, every other row's below it
        g = next(e for e in svg.iter(f"{SVG}g") if e.get("class") == "error")
        for rect in g.iter(f"{SVG}rect"):
            if rect.get("data-rows") is None:
                continue
            row, value = int(rect.get("data-rows", "")), float(rect.get("data-value", ""))
            assert (value > 1) == (row in wrong), (r.case.name, row, value)
            assert rect.get("fill") == (COLOURS["wrong"] if row in wrong
                                        else COLOURS[r.rows.row_class(row)])  # type: ignore
        # the strip's classes are the batch's: tokens read once, more than once, never
        tokens = np.asarray(r.case.tokens if r.case.tokens is not None else
                            r.diagnosis.present_rows)
        if r.case.tokens is not None:
            counts = np.bincount(tokens.reshape(-1), minlength=r.diagnosis.rows_total)
            assert _rows(svg, "rows", "repeated") == set(np.flatnonzero(counts > 1).tolist())
            assert _rows(svg, "rows", "absent") == set(np.flatnonzero(counts == 0).tolist())
    assert some_wrong  # the mutant's bug was drawn


def test_duplicates_buffered_draws_only_repeated_rows_wrong(tmp_path: Path) -> None:
    report = check_target("duplicates-buffered", "model", 0, keep_rows=True)
    out = tmp_path / "rows.html"
    write(report, out)
    for name, svg in _svgs(out.read_text()).items():
        assert _rows(svg, "rows", "wrong") <= _rows(svg, "rows", "repeated"), name


def test_the_command_writes_the_picture_and_says_where(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.html"
    assert main(["check", "output-path-only", "--case", "absent-tokens", "--html", str(out),
                 "-q"]) == 1
    text = capsys.readouterr().out
    assert f"rows drawn: {out}" in text
    page = out.read_text()
    # self-contained: nothing fetched
    assert not re.search(r"""(src|href)=["']?https?:""", page)
    if importlib.util.find_spec("matplotlib") is None:
        assert "report.png not drawn: matplotlib is not installed" in text
        assert not (tmp_path / "report.png").exists()
    else:
        assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_needs_a_target(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "--html", str(tmp_path / "x.html")])
    assert exc.value.code == 2


def test_the_plugin_draws_the_rows_and_links_them_from_the_summary(scratch: Scratch) -> None:
    html, summary = scratch.path / "rows.html", scratch.path / "summary.md"
    result = scratch.runpytest("--tyingspec-adapter=output-path-only", "--tyingspec-profile=ci",
                               "--tyingspec-max-examples=3", "-k", "sum_of_paths",
                               f"--tyingspec-html={html}", f"--tyingspec-summary={summary}")
    assert result.ret == 1
    assert f"rows drawn: {html}" in "\n".join(result.outlines)
    assert 'class="mark wrong"' in html.read_text()
    assert "[rows.html](" in summary.read_text()
