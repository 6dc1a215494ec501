"""Human and JSON reports for ``tyingspec check``: diagnosis first, raw numbers last.

JSON schema ``tyingspec.check/1`` (documented in the README)::

    {"schema": "tyingspec.check/1", "target", "kind", "seed", "verdict", "diagnosis",
     "exit_code", "load_error", "cases": [{"name", "seed", "V", "d", "N", "res", "s_in", "bias",
       "dtype", "status", "stage", "label", "detail", "rows_total", "rows_wrong", "rows_exact",
       "wrong_rows", "max_abs_error", "max_rel_error", "power", "rows_compared", "error",
       "mutated_inputs", "smallest_batch", "replay", "diagnosis"}],
     "quick": null or {"cases_run", "cases_total", "checks"}}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tyingspec._src.core.files import atomic_write
from tyingspec._src.core.render import (
    ROWS_UNOBSERVED,
    diagnosis_lines,
    exact_cell,
    finding_lines,
    power_text,
    projected_text,
    rows_text,
    wrapped,
)

if TYPE_CHECKING:  # annotations only: the check module renders through this one
    from tyingspec._src.front.check import CaseResult, CheckReport

__all__ = ["SCHEMA", "as_json", "exact_cell", "render", "render_case", "rows_text",
           "write_json"]

SCHEMA = "tyingspec.check/1"


def render_case(r: CaseResult, *, structural: bool = True, width: int | None = None
                ) -> list[str]:
    """A case's lines; ``structural=False`` leaves out batch-independent checks (a torch
    model's identity and optimizer checks, run once) that an earlier case already listed.
    With ``width``, the diagnosis is wrapped to it (the batch and the replay command are
    left whole, to be copied).  A case that had no power to decide has no replay line: there
    is no failure to replay."""
    head = {"correct": "ok", "no_power": "NO POWER", "wrong": "WRONG",
            "adapter_error": "ADAPTER ERROR"}[r.status]
    lines = [f"case {r.case.name} ({r.case.describe()}): {head}"]
    if r.error:
        lines.append(f"  error: {r.error}")
    d = r.diagnosis
    # why the precision is not the dtype the target returned: said once, where the precision is
    why = f" ({r.precision_note})" if r.precision_note else ""
    if d is not None and r.status != "correct":
        lines += diagnosis_lines(d, stage=r.stage, mutated=r.mutated)
        if why:
            lines.append(f"  judged at {d.precision}: {r.precision_note}")
    elif d is not None:
        lines.append(f"  {ROWS_UNOBSERVED}" if not d.rows_compared else
                     f"  {power_text(d)}; judged at {d.precision}{why}, worst row "
                     f"{d.margin:.3g}x its rounding bound{projected_text(d)}")
        lines += finding_lines(d, structural=structural)
    if width is not None:
        lines = wrapped(lines, width)
    if r.shrunk is not None:
        lines.append(f"  smallest failing batch: tokens={list(r.shrunk.tokens or ())} "
                     f"targets={list(r.shrunk.targets or ())}"
                     + (f" ({r.shrink_note})" if r.shrink_note else ""))
    elif r.shrink_note:
        lines.append(f"  {r.shrink_note}")
    if r.status in ("wrong", "adapter_error"):
        lines.append(f"  replay: {r.replay}")
    return lines


def render_head(target: str, kind: str, seed: int, precision: str, notes: list[str]) -> str:
    """The first lines of a report: what runs, and any note about the cases."""
    return "\n".join([f"tyingspec check {target} --kind {kind} --seed {seed}"
                      + ("" if precision == "auto" else f" --precision {precision}"), *notes])


def render_verdict(report: CheckReport) -> str:
    """The last line of a report: the verdict and the tally of cases."""
    counts = {s: sum(r.status == s for r in report.results)
              for s in ("correct", "wrong", "no_power", "adapter_error")}
    label = report.diagnosis_label
    tally = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v)
    line = (f"verdict: {report.verdict}" + (f" ({label})" if label != report.verdict else "")
            + (f"; cases: {tally}" if tally else ""))
    if report.verdict == "no_power":  # exit 77: said here, where a CI log is read first
        from tyingspec._src.front.baseline import no_power_text

        line += f"; {no_power_text('case')}"
    if report.quick is not None:  # partial: said on the line a CI log is read by
        line += f"; {report.quick.text()}"
    return line


def render(report: CheckReport, width: int | None = None) -> str:
    """The whole report, its diagnoses wrapped to ``width`` (None: lines left whole)."""
    lines = [render_head(report.target, report.kind, report.seed, report.precision,
                         report.notes)]
    if report.load_error:
        lines.append(f"error: {report.load_error}")
    for r in report.results:
        lines += render_case(r, width=width)
    lines.append(render_verdict(report))
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
        "precision": report.precision,
        "load_error": report.load_error,
        "cases": [r.as_dict() for r in report.results],
        "quick": None if report.quick is None else report.quick.as_dict(),
    })
    return payload


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write the report atomically: a failed write leaves any previous report whole."""
    atomic_write(str(path), json.dumps(payload, indent=2, sort_keys=False) + "\n")
