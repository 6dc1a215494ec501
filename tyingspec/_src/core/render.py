"""One way to show a diagnosis to a person: used by ``tyingspec check``, every property failure
and the pytest plugin.  The diagnosis comes first, the rows next, the raw numbers last.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tyingspec._src.core.cases import Case
from tyingspec._src.core.diagnosis import Diagnosis
from tyingspec._src.core.findings import BY_PATH
from tyingspec._src.core.paths import GAUSSIAN_DIRECTIONS, SAMPLED_COLUMNS


def rows_text(rows: Iterable[Any], limit: int = 16) -> str:
    """``[3, 7, 9]``, cut to ``limit`` entries with ``...`` and the count."""
    rows = [int(r) for r in rows]
    more = f", ... ({len(rows)} rows)" if len(rows) > limit else ""
    return "[" + ", ".join(map(str, rows[:limit])) + more + "]"


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
    lines = [f"diagnosis{when}: {d.label}: {d.headline()}"]
    lines += finding_lines(d, indent="")
    lines += [o.describe() for o in d.others if not o.ok]
    if mutated:
        lines.append(f"the adapter modified its inputs: {', '.join(mutated)}")
    if not d.rows_compared:
        lines.append(ROWS_UNOBSERVED)
        return [indent + line for line in lines]
    lines.append(f"rows: {d.rows_wrong} wrong, {exact_cell(d)} exactly right"
                 + (f"; wrong rows {rows_text(d.wrong_rows)}" if d.wrong_rows else ""))
    lines += [f"  {cause}: rows {rows_text(rows)}" for cause, rows in d.row_causes.items()]
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
             + (f": {f.detail}" if f.detail else "") for f in shown]
    if len(shown) < len(d.findings):
        lines.append(f"{indent}(identity and optimizer checks: as listed for the first case)")
    return lines


def batch_lines(case: Case, indent: str = "  ") -> list[str]:
    """A batch as it replays: shapes and settings, composition, explicit tokens and targets."""
    tokens = "" if case.tokens is None else f" tokens={list(case.tokens)}"
    targets = "" if case.targets is None else f" targets={list(case.targets)}"
    return [f"{indent}{case.describe()}",
            f"{indent}composition={case.composition}{tokens}{targets}"]
