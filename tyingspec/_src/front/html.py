"""A picture of the rows (``tyingspec check ... --html PATH``): one self-contained HTML file,
inline SVG and nothing fetched, and a PNG beside it when matplotlib is installed.

For each case, the V rows of dE left to right:

* a strip coloured by what the batch did with the row: absent (its token not read: the output
  path alone reaches it), present (read once), repeated (read more than once);
* the row's error over its rounding bound, ``max |dE - reference| / bound`` over its entries,
  on a log scale with the bound (1) drawn across; the rows the diagnosis found wrong are red,
  and marked above the strip;
* each path's part of the row over the same bound, ``max |path| / bound``: where it is below
  1, dropping that path could not have shown on that row (the case had no power there).

A vocabulary of more than :data:`MOST_DRAWN` rows is drawn in bins of consecutive rows, each
the worst of its rows (its class the most read of them, wrong when any is).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tyingspec._src.core.diagnosis import Diagnosis
from tyingspec._src.core.extras import hint_text
from tyingspec._src.core.files import atomic_write
from tyingspec._src.core.render import exact_cell, no_addresses, rows_text
from tyingspec._src.front.results import CLASSES, RowProfile, render_verdict

if TYPE_CHECKING:
    from tyingspec._src.engine.observe import Observation
    from tyingspec._src.front.results import CaseResult, CheckReport

#: Rows drawn one element each; past this, bins of consecutive rows.
MOST_DRAWN = 1024
#: Rows per block when the ratios are computed (a [block, d] float64 temporary or three).
_BLOCK = 512

#: Colours: a row's class, and a wrong row (also the bound's line).
COLOURS = {"absent": "#b9b9b9", "present": "#4c78a8", "repeated": "#f58518",
           "wrong": "#d62728"}


def row_profile(obs: Observation) -> RowProfile | str:
    """The rows of an observation as the diagnosis judged them, or why they cannot be drawn."""
    d = obs.diagnosis
    if not d.rows_compared:
        return ("rows not drawn: a use of the tied weight cannot be observed, so the rows are "
                "the model's own, not compared with a reference")
    dE = np.asarray(obs.returned.dE)
    paths = obs.paths
    if dE.ndim != 2 or dE.shape[0] != d.rows_total:
        return f"rows not drawn: dE has shape {dE.shape}, not [{d.rows_total}, d]"
    V = dE.shape[0]
    tol = d.tolerance
    atol = np.broadcast_to(np.asarray(tol.atol, dtype=np.float64).reshape(-1), (V,)) \
        if np.ndim(tol.atol) else np.full(V, float(tol.atol))
    tiny = np.finfo(np.float64).tiny
    error, inp, out = np.zeros(V), np.zeros(V), np.zeros(V)
    for start in range(0, V, _BLOCK):
        rows = np.arange(start, min(V, start + _BLOCK))
        d_in, d_out = paths.in_rows(rows), paths.out_rows(rows)
        ref = d_in + d_out
        # the diagnosis's own allowance (core.diagnosis._scan): atol of the row + rtol |ref|
        allow = np.maximum(atol[rows, None] + tol.rtol * np.abs(ref), tiny)
        actual = np.asarray(dE[rows], dtype=np.float64)
        error[rows] = (np.abs(actual - ref) / allow).max(axis=1, initial=0.0)
        inp[rows] = (np.abs(d_in) / allow).max(axis=1, initial=0.0)
        out[rows] = (np.abs(d_out) / allow).max(axis=1, initial=0.0)
    reads = np.zeros(V, dtype=np.int64)
    reads[np.asarray(d.present_rows, dtype=np.int64)] = 1
    for row, count in d.repeated_rows.items():
        reads[row] = count
    return RowProfile(error, inp, out, reads, frozenset(int(r) for r in d.wrong_rows))


# --- the SVG ---------------------------------------------------------------------------------

_WIDTH, _LEFT, _STRIP, _TALL, _SHORT, _GAP = 960, 130, 14, 120, 56, 10
_FLOOR = -3.0  # log10 of the smallest ratio drawn (a thousandth of the bound)


@dataclass(frozen=True)
class _Bar:
    """One element drawn: a row, or a bin of consecutive rows."""

    first: int
    last: int
    cls: str
    wrong: bool
    error: float
    input_path: float
    output_path: float
    reads: int

    @property
    def label(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def _bars(p: RowProfile) -> list[_Bar]:
    size = max(1, math.ceil(p.V / MOST_DRAWN))
    wrong = np.zeros(p.V, dtype=bool)
    wrong[list(p.wrong)] = True
    bars = []
    for first in range(0, p.V, size):
        s = slice(first, min(p.V, first + size))
        reads = int(p.reads[s].max())
        bars.append(_Bar(first, s.stop - 1, CLASSES[min(2, reads)], bool(wrong[s].any()),
                         float(p.error[s].max()), float(p.input_path[s].max()),
                         float(p.output_path[s].max()), reads))
    return bars


def _height(ratio: float, top: float, tall: float) -> float:
    """A ratio's bar height on a log scale from 10^_FLOOR (0) to 10^top (``tall``)."""
    if not ratio > 0:
        return 0.0
    level = min(top, max(_FLOOR, math.log10(ratio))) if math.isfinite(ratio) else top
    return tall * (level - _FLOOR) / (top - _FLOOR)


def _track(name: str, title: str, bars: list[_Bar], values: list[float], y: float,
           tall: float, *, error: bool) -> list[str]:
    """One track of bars, its baseline at ``y + tall``, on a log scale up to the largest value
    (at least 10), the bound (1) drawn across it."""
    finite = [v for v in values if math.isfinite(v)]
    top = max(1.0, math.ceil(math.log10(max([10.0, *finite]))))
    width = _WIDTH / len(bars)
    out = [f'<g class="{name}">',
           f'<text x="{_LEFT - 8}" y="{y + tall / 2:.1f}" text-anchor="end" '
           f'class="axis">{html.escape(title)}</text>',
           f'<rect x="{_LEFT}" y="{y:.1f}" width="{_WIDTH}" height="{tall}" class="frame"/>']
    for i, (b, v) in enumerate(zip(bars, values)):
        h = _height(v, top, tall)
        bad = error and b.wrong
        out.append(f'<rect class="bar {b.cls}{" wrong" if bad else ""}" '
                   f'data-rows="{b.label}" data-value="{v:.4g}" x="{_LEFT + i * width:.2f}" '
                   f'y="{y + tall - h:.2f}" width="{max(width, 0.5):.2f}" height="{h:.2f}" '
                   f'fill="{COLOURS["wrong"] if bad else COLOURS[b.cls]}"><title>rows '
                   f'{b.label} ({b.cls}{", WRONG" if b.wrong else ""}): {html.escape(title)} '
                   f'{v:.3g}</title></rect>')
    bound = y + tall - _height(1.0, top, tall)
    out += [f'<line class="bound" x1="{_LEFT}" x2="{_LEFT + _WIDTH}" y1="{bound:.2f}" '
            f'y2="{bound:.2f}"/>',
            f'<text x="{_LEFT + _WIDTH + 4}" y="{bound + 4:.2f}" class="axis">1</text>',
            f'<text x="{_LEFT + _WIDTH + 4}" y="{y + 10:.2f}" class="axis">1e{top:.0f}</text>',
            "</g>"]
    return out


def case_svg(p: RowProfile) -> str:
    """A case's rows as an SVG element (see the module docstring): one element per row (per
    bin of rows past :data:`MOST_DRAWN`) in each group, ``data-rows`` naming its rows and the
    class ``wrong`` on those the diagnosis found wrong."""
    bars = _bars(p)
    width = _WIDTH / len(bars)
    y = 4.0
    marks = ['<g class="marks">']
    strip = ['<g class="rows">',
             f'<text x="{_LEFT - 8}" y="{y + 8 + _STRIP - 3}" text-anchor="end" '
             'class="axis">rows</text>']
    for i, b in enumerate(bars):
        x = _LEFT + i * width
        if b.wrong:
            marks.append(f'<rect class="mark wrong" data-rows="{b.label}" x="{x:.2f}" '
                         f'y="{y:.2f}" width="{max(width, 1.5):.2f}" height="6" '
                         f'fill="{COLOURS["wrong"]}"/>')
        strip.append(f'<rect class="row {b.cls}{" wrong" if b.wrong else ""}" '
                     f'data-rows="{b.label}" data-reads="{b.reads}" x="{x:.2f}" '
                     f'y="{y + 8:.2f}" width="{max(width, 0.5):.2f}" height="{_STRIP}" '
                     f'fill="{COLOURS[b.cls]}"><title>rows {b.label}: {b.cls}'
                     f'{f" (read {b.reads} times)" if b.reads > 1 else ""}'
                     f'{", WRONG" if b.wrong else ""}</title></rect>')
    out = [*marks, "</g>", *strip, "</g>"]
    y += 8 + _STRIP + _GAP
    out += _track("error", "error / bound", bars, [b.error for b in bars], y, _TALL,
                  error=True)
    y += _TALL + _GAP
    for name, title, values in (
            ("input", "input path / bound", [b.input_path for b in bars]),
            ("output", "output path / bound", [b.output_path for b in bars])):
        out += _track(name, title, bars, values, y, _SHORT, error=False)
        y += _SHORT + _GAP
    out += [f'<text x="{_LEFT}" y="{y + 2:.0f}" class="axis">row 0</text>',
            f'<text x="{_LEFT + _WIDTH}" y="{y + 2:.0f}" text-anchor="end" class="axis">'
            f"row {p.V - 1}</text>"]
    y += 8
    per_bar = max(1, math.ceil(p.V / MOST_DRAWN))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 40}" '
            f'height="{y:.0f}" data-rows-total="{p.V}" data-rows-per-bar="{per_bar}">'
            + "".join(out) + "</svg>")


# --- the document ----------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 1.6em 0 0.3em; }
.case p { margin: 0.2em 0; } .WRONG { color: #d62728; } .ok { color: #2a7a2a; }
svg .axis { font: 11px system-ui, sans-serif; fill: #444; }
svg .frame { fill: none; stroke: #ddd; } svg .bound { stroke: #d62728; stroke-dasharray: 4 3; }
.legend span { display: inline-block; width: 0.9em; height: 0.9em; margin: 0 0.3em 0 1em;
  vertical-align: -0.1em; }
"""

_HEAD = {"correct": "ok", "no_power": "NO POWER", "wrong": "WRONG",
         "adapter_error": "ADAPTER ERROR"}


def _case_html(r: CaseResult) -> list[str]:
    head = _HEAD[r.status]
    out = [f'<section class="case" data-case="{html.escape(r.case.name)}" '
           f'data-status="{r.status}">',
           f'<h2>case {html.escape(r.case.name)}: <span class="{head.split()[0]}">{head}'
           f"</span></h2>", f"<p>{html.escape(r.case.describe())}</p>"]
    d: Diagnosis | None = r.diagnosis
    if r.error:
        out.append(f"<p>error: {html.escape(r.error)}</p>")
    if d is not None:
        out.append(f"<p><b>{html.escape(d.label)}</b>: "
                   f"{html.escape(no_addresses(d.headline()))}</p>")
        wrong = (f"; wrong rows {rows_text(d.wrong_rows, total=d.rows_total)}"
                 if d.wrong_rows else "")
        out.append(f"<p>rows: {d.rows_wrong} wrong, {exact_cell(d)} exactly right"
                   f"{html.escape(wrong)}; judged at {d.precision}, worst row "
                   f"{d.margin:.3g}x its rounding bound</p>")
    if isinstance(r.rows, RowProfile):
        out.append(case_svg(r.rows))
    elif isinstance(r.rows, str):
        out.append(f"<p><i>{html.escape(r.rows)}</i></p>")
    if r.status in ("wrong", "adapter_error"):
        out.append(f"<p>replay: <code>{html.escape(r.replay)}</code></p>")
    return [*out, "</section>"]


def document(report: CheckReport) -> str:
    """The whole report as one HTML page: the verdict, a legend, each case and its rows."""
    legend = "".join(f'<span style="background:{COLOURS[c]}"></span>{c}' for c in
                     (*CLASSES, "wrong"))
    body = [f"<h1>tyingspec check {html.escape(report.target)} --kind "
            f"{html.escape(report.kind)} --seed {report.seed}</h1>",
            f"<p><b>{html.escape(render_verdict(report))}</b></p>",
            *(f"<p>{html.escape(n)}</p>" for n in report.notes),
            f'<p class="legend">{legend}</p>',
            "<p>Each row of dE, left to right: what the batch did with it; its error over its "
            "rounding bound (log scale, the bound dashed; wrong rows red and marked above); "
            "each path's part over the same bound (below 1, dropping that path could not "
            "show on that row).</p>"]
    if report.load_error:
        body.append(f"<p>error: {html.escape(report.load_error)}</p>")
    for r in report.results:
        body += _case_html(r)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>tyingspec: {html.escape(report.target)}</title>"
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def png_path(path: str | Path) -> Path:
    """Where the PNG beside ``path`` goes: ``report.html`` -> ``report.png``."""
    return Path(path).with_suffix(".png")


def write(report: CheckReport, path: str | Path) -> list[str]:
    """Write the HTML to ``path`` and the PNG beside it (see :func:`png_path`), atomically;
    the lines to print about them.  Without matplotlib the PNG is left out, with a note, never
    an error (raises OSError when a file cannot be written)."""
    atomic_write(str(path), document(report))
    lines = [f"rows drawn: {path}"]
    png = png_path(path)
    try:
        import matplotlib
    except ImportError:
        return lines + [f"{png} not drawn: matplotlib is not installed "
                        f"({hint_text('matplotlib')})"]
    matplotlib.use("Agg")  # a file, never a window
    drawn = [r for r in report.results if isinstance(r.rows, RowProfile)]
    if not drawn:
        return lines + [f"{png} not drawn: no case has rows to draw"]
    _png(drawn, png)
    return lines + [f"rows drawn: {png}"]


#: The PNG's geometry, in inches (fixed, not ``tight_layout``: a row's pixel column follows
#: from :func:`png_layout` alone, so a reader of the file can find each row).
PNG_DPI = 100
_PNG_W, _PNG_LEFT, _PNG_RIGHT = 10.0, 1.3, 0.3
#: Each case's tracks top to bottom, with their heights: the marks above the strip, the strip
#: of row classes, the error track and the two paths' tracks.
_PNG_TRACKS = (("marks", 0.08), ("rows", 0.16), ("error", 1.2), ("input", 0.55),
               ("output", 0.55))
_PNG_TITLE, _PNG_GAP, _PNG_FOOT = 0.3, 0.1, 0.45


Box = tuple[float, float, float, float]  # (left, bottom, width, height), figure fractions


def png_layout(cases: int) -> tuple[tuple[float, float], list[dict[str, Box]]]:
    """The PNG's size in inches and, for each case, each track's box ``(left, bottom, width,
    height)`` in figure fractions (matplotlib's ``add_axes``).  Each track's x axis runs from
    -0.5 to ``bars - 0.5``: bar ``i`` (row ``i``, or bin ``i`` past :data:`MOST_DRAWN` rows,
    as in the SVG) is centred at ``left + (i + 0.5) / bars * width``."""
    panel = _PNG_TITLE + sum(h + _PNG_GAP for _, h in _PNG_TRACKS)
    height = cases * panel + _PNG_FOOT
    left, width = _PNG_LEFT / _PNG_W, (_PNG_W - _PNG_LEFT - _PNG_RIGHT) / _PNG_W
    boxes = []
    top = height
    for _ in range(cases):
        top -= _PNG_TITLE
        box: dict[str, Box] = {}
        for name, h in _PNG_TRACKS:
            box[name] = (left, (top - h) / height, width, h / height)
            top -= h + _PNG_GAP
        boxes.append(box)
    return (_PNG_W, height), boxes


def _png(results: list[CaseResult], path: Path) -> None:
    """The rows of each case as the SVG draws them (:func:`case_svg`), in a PNG: the marks over
    the wrong rows, the strip of row classes, the error track (wrong rows red) and each path's
    track, on log scales with the bound dashed."""
    import os

    import matplotlib.pyplot as plt

    size, layout = png_layout(len(results))
    fig = plt.figure(figsize=size, dpi=PNG_DPI)
    try:
        for r, boxes in zip(results, layout):
            assert isinstance(r.rows, RowProfile)
            _png_case(fig, r, _bars(r.rows), boxes)
        fig.text(_PNG_LEFT / _PNG_W, 0.15 * _PNG_FOOT / size[1],
                 "row of dE, left to right: grey absent, blue present, orange repeated; "
                 "red: wrong (marked above)", fontsize=8)
        # written beside the target and renamed over it: a failed write leaves the old one
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
        try:
            fig.savefig(tmp, dpi=PNG_DPI)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        plt.close(fig)


def _png_case(fig: Any, r: CaseResult, bars: list[_Bar],
              boxes: dict[str, Box]) -> None:
    x = np.arange(len(bars))
    flat = {"linewidth": 0, "antialiased": False, "width": 1.0}  # a row's pixels: its colour

    def axes(name: str, title: str) -> Any:
        ax = fig.add_axes(boxes[name])
        ax.set_xlim(-0.5, len(bars) - 0.5)
        ax.set_xticks([])
        ax.set_ylabel(title, rotation=0, ha="right", va="center", fontsize=7)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        return ax

    marks = axes("marks", "")
    marks.set_axis_off()
    marks.set_ylim(0, 1)
    wrong = [b.wrong for b in bars]
    marks.bar(x[wrong], 1.0, color=COLOURS["wrong"], **flat)
    strip = axes("rows", "rows")
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.bar(x, 1.0, color=[COLOURS[b.cls] for b in bars], **flat)
    tracks = (("error", "error / bound", [b.error for b in bars], True),
              ("input", "input path\n/ bound", [b.input_path for b in bars], False),
              ("output", "output path\n/ bound", [b.output_path for b in bars], False))
    for name, title, values, error in tracks:
        ax = axes(name, title)
        finite = [v for v in values if math.isfinite(v)]
        top = 10.0 ** max(1.0, math.ceil(math.log10(max([10.0, *finite]))))
        floor = 10.0 ** _FLOOR
        heights = [min(top, max(floor, v)) if math.isfinite(v) else top for v in values]
        ax.bar(x, heights, color=[COLOURS["wrong"] if error and b.wrong else COLOURS[b.cls]
                                  for b in bars], **flat)
        ax.set_yscale("log")
        ax.set_ylim(floor, top)
        ax.tick_params(labelsize=6)
        ax.axhline(1.0, color=COLOURS["wrong"], ls="--", lw=0.8)
    fig.text(boxes["marks"][0], boxes["marks"][1] + boxes["marks"][3]
             + 0.3 * _PNG_TITLE / fig.get_figheight(),
             f"case {r.case.name}: {_HEAD[r.status]}"
             + (f" ({r.diagnosis.label})" if r.diagnosis is not None else ""), fontsize=9)
