"""Human and JSON reports for ``tyingspec check``: diagnosis first, raw numbers last.

JSON schema ``tyingspec.check/1`` (documented in the README)::

    {"schema": "tyingspec.check/1", "target", "kind", "seed", "verdict", "diagnosis",
     "exit_code", "load_error", "cases": [{"name", "seed", "V", "d", "N", "res", "s_in", "bias",
       "dtype", "status", "stage", "label", "detail", "rows_total", "rows_wrong", "rows_exact",
       "wrong_rows", "max_abs_error", "max_rel_error", "power", "error", "mutated_inputs",
       "smallest_batch", "replay", "diagnosis"}]}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ._check import CaseResult, CheckReport
from ._diagnosis import Diagnosis

SCHEMA = "tyingspec.check/1"


def exact_cell(d: Diagnosis) -> str:
    """'64 of 64', '56 of 64 (87.5%)' or '0': the form of the write-up's table."""
    if d.rows_exact == 0:
        return "0"
    if d.rows_exact == d.rows_total:
        return f"{d.rows_exact} of {d.rows_total}"
    return f"{d.rows_exact} of {d.rows_total} ({100.0 * d.rows_exact / d.rows_total:.1f}%)"


def rows_text(rows: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return f"[{shown}{', ...' if len(rows) > limit else ''}]"


def _power_text(d: Diagnosis) -> str:
    def yn(v: bool | None) -> str:
        return "n/a" if v is None else ("yes" if v else "NO")

    p = d.power
    return (f"power: input path {yn(p.input_path)}, output path {yn(p.output_path)}, "
            f"duplicates {yn(p.duplicates)}")


def render_case(r: CaseResult) -> list[str]:
    head = {"correct": "ok", "no_power": "NO POWER", "wrong": "WRONG",
            "adapter_error": "ADAPTER ERROR"}[r.status]
    lines = [f"case {r.case.name} ({r.case.describe()}): {head}"]
    if r.error:
        lines.append(f"  error: {r.error}")
    d = r.diagnosis
    if d is not None:
        when = "" if r.stage == "first call" else f" ({r.stage} of E with the returned dE)"
        lines.append(f"  diagnosis{when}: {d.headline()}")
        for o in d.others:
            if not o.ok:
                lines.append(f"  {o.describe()}")
        if r.mutated:
            lines.append(f"  the adapter modified its inputs: {', '.join(r.mutated)}")
        lines.append(f"  rows: {d.rows_wrong} wrong, {exact_cell(d)} exactly right"
                     + (f"; wrong rows {rows_text(d.wrong_rows)}" if d.wrong_rows else ""))
        for cause, rows in d.row_causes.items():
            lines.append(f"    {cause}: rows {rows_text(rows)}")
        lines.append(f"  {_power_text(d)}")
    if r.shrunk is not None:
        lines.append(f"  smallest failing batch: tokens={list(r.shrunk.tokens or ())} "
                     f"targets={list(r.shrunk.targets or ())}")
    if r.status != "correct":
        lines.append(f"  replay: {r.replay}")
    if d is not None and r.status != "correct":
        lines.append(f"  max abs error {d.max_abs_error:.3g}, max rel error "
                     f"{d.max_rel_error:.3g} under {d.tolerance.describe()}")
    return lines


def render(report: CheckReport) -> str:
    lines = [f"tyingspec check {report.target} --kind {report.kind} --seed {report.seed}"]
    if report.load_error:
        lines.append(f"error: {report.load_error}")
    for r in report.results:
        lines += render_case(r)
    counts = {s: sum(r.status == s for r in report.results)
              for s in ("correct", "wrong", "no_power", "adapter_error")}
    label = report.diagnosis_label
    tally = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v)
    lines.append(f"verdict: {report.verdict}" + (f" ({label})" if label != report.verdict else "")
                 + (f"; cases: {tally}" if tally else ""))
    return "\n".join(lines)


def _finite(x: Any) -> Any:
    """JSON has no inf/NaN: encode them as strings rather than emit invalid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def as_json(report: CheckReport) -> dict[str, Any]:
    payload: dict[str, Any] = _finite({
        "schema": SCHEMA,
        "target": report.target,
        "kind": report.kind,
        "seed": report.seed,
        "verdict": report.verdict,
        "diagnosis": report.diagnosis_label,
        "exit_code": report.exit_code,
        "load_error": report.load_error,
        "cases": [r.as_dict() for r in report.results],
    })
    return payload


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
