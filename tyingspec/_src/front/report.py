"""Human and JSON reports for ``tyingspec check``: diagnosis first, raw numbers last (the
human one is rendered in ``front.results``, with the report it renders).

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
from typing import Any

from tyingspec._src.core.files import atomic_write
from tyingspec._src.core.render import exact_cell, rows_text
from tyingspec._src.front.results import (
    CheckReport,
    render,
    render_case,
    render_head,
    render_verdict,
)

# the text a person reads is rendered with the results (``CheckReport.diagnosis`` is that
# text); its functions are named here too, beside the JSON report, where the front ends look
__all__ = ["SCHEMA", "as_json", "exact_cell", "render", "render_case", "render_head",
           "render_verdict", "rows_text", "write_json"]

SCHEMA = "tyingspec.check/1"


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
