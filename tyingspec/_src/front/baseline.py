"""The CI regression gate: a recorded verdict per property (pytest) or per case (``check``).

A baseline is a small versioned JSON file::

    {"schema": "tyingspec.baseline/1", "unit": "property", "target": "pkg.mod:fn",
     "kind": "model", "verdicts": {"sum_of_paths": "passed", ...},
     "details": {"sum_of_paths": ""}}

A later run compares its verdicts with it: anything that ``passed`` in the baseline and now
``failed`` (or hit an adapter error) is a regression, and the run fails even when every other
counter says it passed.  A missing file is recorded on the first run, except under CI (``$CI``
set, as GitHub Actions sets ``CI=true``): there it was not committed, and a run that recorded
it would compare nothing, in every fresh checkout, for ever; so it fails the run unless the
update flag asks for it to be written (syrupy's convention).  Only the explicit update flag
rewrites an existing one.  This module is cheap to import (json and os only): the pytest
plugin loads it in the controller process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.files import atomic_write, create_exclusive
from tyingspec._src.front.results import CheckReport

SCHEMA = "tyingspec.baseline/1"
UNITS = ("property", "case")

PASSED, FAILED, ADAPTER_ERROR, ERROR, SKIPPED, NO_POWER = (
    "passed", "failed", "adapter_error", "error", "skipped", "no_power")
VERDICTS = (PASSED, FAILED, ADAPTER_ERROR, ERROR, SKIPPED, NO_POWER)
#: A verdict in this set after ``passed`` in the baseline is a regression.
FAILING = frozenset({FAILED, ADAPTER_ERROR, ERROR})

#: ``tyingspec check`` case statuses as baseline verdicts.
CHECK_STATUS = {"correct": PASSED, "wrong": FAILED, "adapter_error": ADAPTER_ERROR,
                "no_power": NO_POWER}

#: What each invariant code of the property suite means (the bug catalogue's names), for the
#: legend a summary prints under the codes it uses.  A test keeps it in step with every code a
#: registered property carries.
INVARIANTS = {
    "SUM": "dE = input path + output path on every row",
    "ROWS": "rows of tokens absent from the batch get the output path only",
    "DUP": "a token seen k times gets all k contributions",
    "PERM": "relabelling the vocabulary permutes the rows of dE",
    "ACC": "gradients accumulate across micro-batches and start from zero",
    "OUT": "the loss, dW and db equal the reference",
    "PURE": "the implementation writes into none of its inputs",
    "FRESH": "the same call twice gives the same gradient",
    "ID": "the tie is one tensor: after an optimizer step and every transformation",
    "LIN": "the kernel is linear in the upstream gradients dx and g",
    "SCALE": "no path or output is scaled by a stray factor",
}


def legend(codes: Iterable[str]) -> list[tuple[str, str]]:
    """(code, meaning) for each distinct code in ``codes``, in first-seen order; an unknown code
    is listed as such rather than dropped (it must not read as defined)."""
    seen = dict.fromkeys(c for c in codes if c)
    return [(c, INVARIANTS.get(c, "(no description)")) for c in seen]


def in_ci() -> bool:
    """Whether this run is CI's: ``$CI`` set to anything non-empty (GitHub Actions, GitLab CI
    and most others set ``CI=true``), where a missing baseline is an error, not a first run."""
    return bool(os.environ.get("CI"))


def _plural(n: int, unit: str) -> str:
    if n == 1:
        return unit
    return "properties" if unit == "property" else unit + "s"


class BaselineError(TyingspecError):
    """The baseline file cannot be read or is not a tyingspec baseline of the expected unit."""


@dataclass(frozen=True)
class Baseline:
    """Verdicts of one run: ``verdicts[name]`` is one of :data:`VERDICTS`."""

    unit: str
    target: str
    kind: str
    verdicts: dict[str, str]
    details: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "unit": self.unit, "target": self.target, "kind": self.kind,
                "verdicts": dict(sorted(self.verdicts.items())),
                "details": dict(sorted(self.details.items()))}


@dataclass(frozen=True)
class Change:
    """One name whose verdict differs between the baseline and this run."""

    name: str
    before: str | None  # None: not in the baseline
    after: str | None  # None: not run this time
    detail: str = ""

    def describe(self) -> str:
        after = self.after if self.after is not None else "not run"
        text = f"{self.name}: {self.before or 'new'} -> {after}"
        return text + (f" ({self.detail})" if self.detail else "")


@dataclass
class GateResult:
    """What comparing (or recording) a baseline found; ``lines()`` is what a person reads."""

    path: str
    # "compared" | "recorded" (file was missing) | "updated" (explicit flag rewrote it) |
    # "missing" (file missing under CI and no update flag: nothing recorded, the run fails)
    action: str
    unit: str
    regressions: list[Change] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # other differences, for information
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.action == "missing" or (self.action == "compared" and bool(self.regressions))

    def lines(self, update_hint: str) -> list[str]:
        n = len(self.regressions)
        out: list[str] = []
        if self.action == "missing":
            out.append(f"baseline {self.path} does not exist: it was not committed, so there is "
                       "nothing to compare this run's verdicts against")
            out.append("under CI ($CI is set) a missing baseline fails the run instead of being "
                       "recorded: each fresh checkout would record its own and compare nothing")
            out.append(f"record it: run once with {update_hint} (outside CI, or here) and commit "
                       f"{self.path}")
        elif self.failed:
            out.append(f"REGRESSION: {n} {_plural(n, self.unit)} passed in baseline {self.path} "
                       f"and fail{'s' if n == 1 else ''} now:")
            out += [f"  {c.describe()}" for c in self.regressions]
            out.append(f"fix the implementation, or accept the new verdicts with {update_hint} "
                       f"(rewrites {self.path})")
        elif self.action == "recorded":
            out.append(f"baseline {self.path} did not exist: recorded this run's verdicts "
                       "(nothing to compare against yet)")
        elif self.action == "updated":
            out.append(f"baseline {self.path} rewritten with this run's verdicts")
            if self.regressions:
                out.append("accepted (passed before, fail now): "
                           + "; ".join(c.describe() for c in self.regressions))
        else:
            out.append(f"baseline {self.path}: no {self.unit} that passed there fails now")
        if self.changes:
            out.append("other changes since the baseline: "
                       + "; ".join(c.describe() for c in self.changes))
        out += self.notes
        return out


def load(path: str, unit: str) -> Baseline | None:
    """Read a baseline; ``None`` when the file does not exist."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise BaselineError(f"baseline {path}: cannot be read as JSON "
                            f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise BaselineError(f"baseline {path}: expected schema {SCHEMA!r}, got {got!r}")
    if raw.get("unit") != unit:
        who = {"property": "the pytest plugin (property verdicts)",
               "case": "`tyingspec check` (case verdicts)"}
        got_unit = str(raw.get("unit"))
        raise BaselineError(f"baseline {path}: recorded by {who.get(got_unit, repr(got_unit))}, "
                            f"but this run records {who[unit]}; use a separate file for each")
    verdicts = raw.get("verdicts")
    if not isinstance(verdicts, dict) or not all(
            isinstance(k, str) and v in VERDICTS for k, v in verdicts.items()):
        raise BaselineError(f"baseline {path}: 'verdicts' must map names to one of "
                            f"{', '.join(VERDICTS)}; got {verdicts!r}")
    details = raw.get("details", {})
    if not isinstance(details, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in details.items()):
        raise BaselineError(f"baseline {path}: 'details' must map names to strings; got "
                            f"{type(details).__name__} {str(details)[:80]!r}")
    return Baseline(unit, str(raw.get("target", "")), str(raw.get("kind", "")),
                    dict(verdicts), dict(details))


def _text(baseline: Baseline) -> str:
    return json.dumps(baseline.as_json(), indent=2) + "\n"


def save(path: str, baseline: Baseline) -> None:
    """Write atomically (a crashed run never leaves half a baseline; a symlink keeps pointing
    at it; the file keeps its mode), sorted for clean diffs."""
    atomic_write(path, _text(baseline))


def compare(before: Baseline, now: Baseline) -> tuple[list[Change], list[Change]]:
    """(regressions, other changes) between a baseline and this run's verdicts."""
    regressions: list[Change] = []
    changes: list[Change] = []
    for name in sorted(set(before.verdicts) | set(now.verdicts)):
        b, a = before.verdicts.get(name), now.verdicts.get(name)
        if b == a:
            continue
        change = Change(name, b, a, now.details.get(name, ""))
        if b == PASSED and a in FAILING:
            regressions.append(change)
        elif a is not None:  # not run this time (e.g. -k): not a change worth listing
            changes.append(change)
    return regressions, changes


def gate(path: str, now: Baseline, *, update: bool, ci: bool = False) -> GateResult:
    """Compare ``now`` with the baseline at ``path``; record it if missing, rewrite on ``update``.

    With ``ci`` (see :func:`in_ci`) a missing baseline is not recorded unless ``update``: the
    result's action is ``missing`` and it fails.  Raises :class:`BaselineError` for an
    unreadable baseline unless ``update`` (which replaces it).
    """
    try:
        before = load(path, now.unit)
    except BaselineError:
        if not update:
            raise
        save(path, now)  # unreadable: replaced whole
        return GateResult(path, "updated", now.unit)
    if before is None:
        if update:  # nothing was there to rewrite: a first recording, asked for
            save(path, now)
            return GateResult(path, "recorded", now.unit)
        if ci:
            return GateResult(path, "missing", now.unit)
        if not create_exclusive(path, _text(now)):
            # another run recorded it between our read and our write: compare against theirs
            return gate(path, now, update=False, ci=ci)
        return GateResult(path, "recorded", now.unit)
    regressions, changes = compare(before, now)
    result = GateResult(path, "updated" if update else "compared", now.unit,
                        regressions, changes)
    if (before.target, before.kind) != (now.target, now.kind):
        result.notes.append(f"note: the baseline was recorded for target {before.target!r} "
                            f"({before.kind}); this run checks {now.target!r} ({now.kind})")
    if update:
        # Names not run this time (a -k subset, a --case replay) keep their recorded verdict.
        kept = {n: v for n, v in before.verdicts.items() if n not in now.verdicts}
        if kept:
            result.notes.append(f"kept {len(kept)} recorded verdict(s) not run this time: "
                                + ", ".join(sorted(kept)))
        save(path, Baseline(now.unit, now.target, now.kind, {**kept, **now.verdicts},
                            {**{n: d for n, d in before.details.items() if n in kept},
                             **now.details}))
    return result


def summary_markdown(title: str, rows: Iterable[tuple[str, str, str, str]],
                     gate_lines: list[str] | None = None) -> str:
    """A markdown report for a CI step summary: property | invariant | verdict | diagnosis."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ").strip() or " "

    icon = {PASSED: "✅", FAILED: "❌", ADAPTER_ERROR: "⚠️", ERROR: "❌", SKIPPED: "⏭️",
            NO_POWER: "❔"}
    rows = list(rows)
    out = [f"## {title}", "", "| property | invariant | verdict | diagnosis |", "|---|---|---|---|"]
    for name, invariant, verdict, diagnosis in rows:
        out.append(f"| `{cell(name)}` | {cell(invariant)} | {icon.get(verdict, '')} "
                   f"{cell(verdict)} | {cell(diagnosis)} |")
    codes = legend(r[1] for r in rows)
    if codes:
        out += ["", "Invariants:", "", *(f"- **{cell(c)}**: {cell(text)}" for c, text in codes)]
    if gate_lines:
        out += ["", "### Baseline", "", "```", *gate_lines, "```"]
    return "\n".join(out) + "\n"


def check_verdicts(report: CheckReport, names: Iterable[str] = ()) -> Baseline:
    """A ``tyingspec check`` report as case verdicts; a target that failed to load is an adapter
    error on every case it would have run (``names``: the cases known from the baseline)."""
    verdicts: dict[str, str] = {}
    details: dict[str, str] = {}
    for r in report.results:
        verdicts[r.case.name] = CHECK_STATUS.get(r.status, ERROR)
        if r.status == "adapter_error":
            details[r.case.name] = r.error or ""
        elif r.diagnosis is not None and r.status == "wrong":
            details[r.case.name] = r.diagnosis.label
    if report.load_error:
        for name in names:
            verdicts[name] = ADAPTER_ERROR
            details[name] = "target cannot be loaded"
    return Baseline("case", report.target, report.kind, verdicts, details)


def apply_check_baseline(report: CheckReport, path: str, update: bool,
                         ci: bool | None = None) -> tuple[int, list[str]]:
    """Gate a ``tyingspec check`` run on a baseline file: returns (exit code, lines to print).

    Exit code: the report's own, raised to 1 on a regression; 2 if the baseline is unreadable,
    or missing under CI (``ci``; default :func:`in_ci`), where it is not recorded.
    """
    ci = in_ci() if ci is None else ci
    if report.load_error and (update or not os.path.exists(path)):
        what = "updated" if update else "recorded"
        return 2, [(f"tyingspec: baseline {path} not {what}: the target cannot be loaded, so "
                    "there are no verdicts to record")]
    try:
        before = None if update else load(path, "case")
    except BaselineError as exc:
        return 2, [f"tyingspec: {exc}"]
    now = check_verdicts(report, before.verdicts if before is not None else ())
    try:
        result = gate(path, now, update=update, ci=ci)
    except BaselineError as exc:
        return 2, [f"tyingspec: {exc}"]
    except OSError as exc:
        return 2, [f"tyingspec: baseline {path} cannot be written ({type(exc).__name__}: {exc})"]
    if result.action == "missing":  # like an unreadable baseline: the gate could not run
        return 2, result.lines("--update-baseline")
    # a regression is a case that passed and fails now (1), unless an adapter error says 2
    code = (2 if report.exit_code == 2 else 1) if result.failed else report.exit_code
    return code, result.lines("--update-baseline")


__all__ = ["INVARIANTS", "Baseline", "BaselineError", "Change", "GateResult",
           "apply_check_baseline", "check_verdicts", "compare", "gate", "in_ci", "legend", "load",
           "save", "summary_markdown"]
