"""``tyingspec check --html PATH`` (and the plugin's ``--tyingspec-html``): the picture of the
rows is read back from the file, and the rows it draws wrong are exactly the diagnosis' wrong
rows, each row coloured by what the batch did with it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
from conftest import Scratch

from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.front.html import (
    COLOURS,
    MOST_DRAWN,
    PNG_DPI,
    RowProfile,
    png_layout,
    write,
)

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
        assert f"rows drawn: {tmp_path / 'report.png'}" in text
        assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_png_is_left_out_with_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # whether or not matplotlib is installed here: None in sys.modules makes its import fail
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "report.html"
    assert main(["check", "output-path-only", "--case", "absent-tokens", "--html", str(out),
                 "-q"]) == 1
    text = capsys.readouterr().out
    assert f"rows drawn: {out}" in text and out.exists()
    assert "report.png not drawn: matplotlib is not installed" in text
    assert "pip install" in text  # the note says how to get it
    assert not (tmp_path / "report.png").exists()


def _png_colour(image: np.ndarray, box: tuple[float, ...], bar: float, bars: int,
                height: float = 0.5) -> str:
    """The colour of a PNG read back, in a track's ``box`` (figure fractions, y up as in
    matplotlib) at the centre of bar ``bar`` of ``bars``, ``height`` of the way up the box."""
    left, bottom, width, tall = box
    x, y = left + (bar + 0.5) / bars * width, bottom + height * tall
    h, w = image.shape[:2]
    px = image[int((1.0 - y) * h), int(x * w)]
    rgb = np.round(np.asarray(px[:3], dtype=np.float64) * 255).astype(int)
    return "#" + "".join(f"{c:02x}" for c in rgb)


@pytest.mark.parametrize("mutant", ["duplicates-buffered", "output-path-only"])
def test_the_png_draws_the_diagnosis_wrong_rows_wrong(tmp_path: Path, mutant: str) -> None:
    pytest.importorskip("matplotlib")  # the dev extra installs it: CI runs this
    from matplotlib.image import imread

    report = check_target(mutant, "model", 0, keep_rows=True)
    out = tmp_path / "rows.html"
    assert f"rows drawn: {tmp_path / 'rows.png'}" in write(report, out)
    image = imread(tmp_path / "rows.png")
    drawn = [r for r in report.results if isinstance(r.rows, RowProfile)]
    size, layout = png_layout(len(drawn))
    assert image.shape[:2] == (round(size[1] * PNG_DPI), round(size[0] * PNG_DPI))
    some_wrong = False
    for r, boxes in zip(drawn, layout):
        assert r.diagnosis is not None and isinstance(r.rows, RowProfile)
        V = r.rows.V
        assert V <= MOST_DRAWN  # one bar per row: bar i is row i
        wrong = {int(x) for x in r.diagnosis.wrong_rows}
        some_wrong |= bool(wrong)

        def at(track: str, row: int, height: float = 0.5, *, boxes: dict[str, tuple[
                float, ...]] = boxes, V: int = V) -> str:
            return _png_colour(image, boxes[track], row, V, height)

        for row in range(V):
            # a red mark above exactly the wrong rows; the strip coloured by the row's class;
            # the error bar red at the wrong rows (which stand above the bound), at its foot
            assert at("marks", row) == (COLOURS["wrong"] if row in wrong else "#ffffff"), \
                (r.case.name, row)
            assert at("rows", row) == COLOURS[r.rows.row_class(row)], (r.case.name, row)
            if row in wrong:
                assert at("error", row, 0.02) == COLOURS["wrong"], (r.case.name, row)
            elif r.rows.error[row] > 10.0 ** -2:  # a bar tall enough to show at its foot
                assert at("error", row, 0.02) == COLOURS[r.rows.row_class(row)], (r.case.name,
                                                                                    row)
    assert some_wrong  # the mutant's bug was drawn


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
