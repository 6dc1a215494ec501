"""One way to show a diagnosis to a person: used by ``tyingspec check``, every property failure
and the pytest plugin.  The diagnosis comes first, the rows next, the raw numbers last.

What a person reads carries no storage address (a torch tensor's ``data_ptr``, which says
nothing the sentence does not and changes every run: ``--json`` keeps them), and a front end
that prints it to a terminal wraps it to the terminal's width (:func:`wrapped`): a diagnosis
line ran to 900 characters.  Printed to a pipe or a log, a line is left whole.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from tyingspec._src.core.cases import Case
from tyingspec._src.core.diagnosis import Diagnosis
from tyingspec._src.core.findings import BY_PATH
from tyingspec._src.core.paths import GAUSSIAN_DIRECTIONS, SAMPLED_COLUMNS


def rows_text(rows: Iterable[Any], limit: int = 16, total: int | None = None) -> str:
    """``[3, 7, 9]``, cut to ``limit`` entries with ``...`` and the count; with ``total`` (the
    rows there are), the count of the whole: ``[3, 7, 9] (3 of 64)``."""
    rows = [int(r) for r in rows]
    cut = len(rows) > limit
    if total is not None:
        return ("[" + ", ".join(map(str, rows[:limit])) + (", ..." if cut else "") + "]"
                + f" ({len(rows)} of {total})")
    more = f", ... ({len(rows)} rows)" if cut else ""
    return "[" + ", ".join(map(str, rows[:limit])) + more + "]"


#: A storage address in a sentence: ``(0x7f3a...)``, ``(storages 0x.. and 0x..)``, ``(equal
#: values, storages 0x.. and 0x..)``.
_HEX = r"0x[0-9a-fA-F]+"
_ALONE = re.compile(rf"\s*\((?:storages?\s+)?{_HEX}(?:\s*(?:,|and)\s*{_HEX})*\)")
_AMONG = re.compile(rf",\s*storages?\s+{_HEX}(?:\s*(?:,|and)\s*{_HEX})*")


def no_addresses(text: str) -> str:
    """``text`` without the storage addresses in it (what ``--json`` keeps): a parenthesis
    that held only addresses goes with them."""
    text = _AMONG.sub("", _ALONE.sub("", text))
    return re.sub(_HEX, "an address", text)


#: Characters a wrapped line's continuation is indented by, past its first line's indent.
HANG = 4


def terminal_width(stream: TextIO | None = None) -> int | None:
    """The width to wrap a report to: the terminal's when ``stream`` (default stdout) is one
    (never below 40), else None: a pipe or a CI log keeps each line whole, for grep."""
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty():
            return None
        return max(40, os.get_terminal_size(stream.fileno()).columns or 100)
    except (AttributeError, OSError, ValueError):  # a replaced stdout, a closed one
        return None


def wrapped(lines: Sequence[str], width: int | None) -> list[str]:
    """``lines`` wrapped at ``width`` (None: left whole), each continuation indented
    :data:`HANG` past its line's own indent.  A row list (``[3, 7, 12] (3 of 64)``) or code
    in backticks is never cut, nor a word: a line is broken at spaces between them only."""
    if width is None:
        return list(lines)
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip(" "))]
        # inside a row list or backticks a space is no break: a no-break space, put back after
        kept = re.sub(r"\[[-\d, .]*\](?: \(\d+ of \d+\))?|`[^`]*`",
                      lambda m: m.group(0).replace(" ", "\u00a0"), line)
        parts = textwrap.wrap(kept.strip(" "), width=width, initial_indent=indent,
                              subsequent_indent=indent + " " * HANG, break_long_words=False,
                              break_on_hyphens=False)
        out += [p.replace("\u00a0", " ") for p in parts]
    return out


def exact_cell(d: Diagnosis) -> str:
    """'64 of 64', '56 of 64 (87.5%)' or '0': the form of the write-up's table."""
    if d.rows_exact == 0:
        return "0"
    if d.rows_exact == d.rows_total:
        return f"{d.rows_exact} of {d.rows_total}"
    return f"{d.rows_exact} of {d.rows_total} ({100.0 * d.rows_exact / d.rows_total:.1f}%)"


def projected_text(d: Diagnosis) -> str:
    """'' or '; 49233 of 50257 rows (...) through projections' (see core.paths.Sketch)."""
    if not d.rows_projected:
        return ""
    return (f"; {d.rows_projected} of {d.rows_total} rows (tokens absent from the batch) "
            f"through {SAMPLED_COLUMNS} sampled columns and {GAUSSIAN_DIRECTIONS} Gaussian "
            "directions")


def power_text(d: Diagnosis) -> str:
    def yn(v: bool | None) -> str:
        return "n/a" if v is None else ("yes" if v else "NO")

    p = d.power
    return (f"power: input path {yn(p.input_path)}, output path {yn(p.output_path)}, "
            f"duplicates {yn(p.duplicates)}")


#: What a report says of the rows where a use of the tie cannot be observed: they are the
#: model's own gradient, split as its backward split it, so their count, power and margin
#: would describe a comparison with itself ("0 wrong, all exactly right" beside a forward
#: check that found rows wrong).
ROWS_UNOBSERVED = (f"rows: not compared with a reference: a use of the tied weight cannot be "
                   f"observed, so the rows are the model's own ({BY_PATH}: n/a); the gradient "
                   "against the forward judges them")


def diagnosis_lines(d: Diagnosis, *, stage: str = "first call",
                    mutated: tuple[str, ...] = (), indent: str = "  ") -> list[str]:
    """The diagnosis block: label and sentence, other outputs, rows, causes, power, numbers."""
    when = "" if stage == "first call" else f" ({stage} of E with the returned dE)"
    lines = [f"diagnosis{when}: {d.label}: {no_addresses(d.headline())}"]
    lines += finding_lines(d, indent="")
    lines += [o.describe() for o in d.others if not o.ok]
    if mutated:
        lines.append(f"the adapter modified its inputs: {', '.join(mutated)}")
    if not d.rows_compared:
        lines.append(ROWS_UNOBSERVED)
        return [indent + line for line in lines]
    lines.append(f"rows: {d.rows_wrong} wrong, {exact_cell(d)} exactly right"
                 + (f"; wrong rows {rows_text(d.wrong_rows, total=d.rows_total)}"
                    if d.wrong_rows else ""))
    lines += [f"  {cause}: rows {rows_text(rows, total=d.rows_total)}"
              for cause, rows in d.row_causes.items()]
    lines.append(power_text(d))
    lines.append(f"judged at {d.precision}: worst row {d.margin:.3g}x its rounding bound; max "
                 f"abs error {d.max_abs_error:.3g}, max rel error {d.max_rel_error:.3g} under "
                 f"{d.tolerance.describe()}{projected_text(d)}")
    return [indent + line for line in lines]


#: Checks that do not depend on the batch (run once per target, listed once per report).
STRUCTURAL = ("identity", "optimizer")


def finding_lines(d: Diagnosis, indent: str = "  ", *, structural: bool = True) -> list[str]:
    """One line per named check beyond rows: outcome, check, the invariant, what was seen."""
    mark = {"passed": "ok  ", "failed": "FAIL", "not_applicable": "n/a "}
    shown = [f for f in d.findings if structural or f.failed
             or not f.check.startswith(STRUCTURAL)]
    lines = [f"{indent}{mark[f.outcome]} {f.check} [{f.invariant}]"
             + (f": {no_addresses(f.detail)}" if f.detail else "") for f in shown]
    if len(shown) < len(d.findings):
        lines.append(f"{indent}(identity and optimizer checks: as listed for the first case)")
    return lines


def batch_lines(case: Case, indent: str = "  ") -> list[str]:
    """A batch as it replays: shapes and settings, composition, explicit tokens and targets."""
    tokens = "" if case.tokens is None else f" tokens={list(case.tokens)}"
    targets = "" if case.targets is None else f" targets={list(case.targets)}"
    return [f"{indent}{case.describe()}",
            f"{indent}composition={case.composition}{tokens}{targets}"]
