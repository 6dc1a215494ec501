"""What a check found: each case's :class:`CaseResult`, the target's :class:`CheckReport`
(verdict, exit status, the text a person reads) and :class:`CheckFailed`, raised for a report
that did not pass.

Kept apart from the run (``front.check``) and the JSON report (``front.report``), which both
import this module and neither of which it imports (issue 54: the two named each other's
types).  The report's text is rendered here, not in ``front.report``, because
``CheckReport.diagnosis`` is that text: rendering it there would tie the two modules again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tyingspec._src.core.cases import Case
from tyingspec._src.core.diagnosis import Diagnosis, run_label
from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.render import (
    ROWS_UNOBSERVED,
    diagnosis_lines,
    finding_lines,
    power_text,
    projected_text,
    wrapped,
)
from tyingspec._src.engine.observe import FIRST_CALL, Stage, Status

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CLASSES", "EXIT_NO_POWER", "EXIT_STATUS", "CaseResult", "CheckFailed", "CheckReport",
           "NoPower", "Quick", "RowProfile", "no_power_text", "render", "render_case",
           "render_head", "render_verdict"]

#: The exit status of a run in which no case (``tyingspec check``) or no property (the pytest
#: plugin) had the power to decide: a correct gradient judged where no check could have told
#: it from a broken one (a float32 model at ``--precision bfloat16``).  Neither 0 (correct) nor
#: 1 (a wrong gradient, and nothing else), 2 (a usage or adapter error) or 130 (interrupted);
#: 77, automake's and meson's status for a test that could not decide (a harness shows it as
#: neither pass nor fail), so that the plugin's run exits with the same status as the command:
#: pytest's own statuses grow from 0 upward (9.2 added 6, ``MAX_WARNINGS_ERROR``, which an
#: earlier choice of 6 collided with) and the shell's start at 126.
EXIT_NO_POWER = 77
#: ``tyingspec check``'s exit status for each verdict of a run.
EXIT_STATUS = {"correct": 0, "wrong": 1, "adapter_error": 2, "no_power": EXIT_NO_POWER}


def no_power_text(unit: str) -> str:
    """What a run in which no ``unit`` (case, property) had the power to decide says."""
    return (f"no {unit} had the power to decide (exit {EXIT_NO_POWER}): a gradient with a "
            f"path dropped would have passed every {unit} too, so this is neither a pass nor a "
            "wrong gradient; check at a precision whose rounding bound is below a path (a "
            "float32 build, --precision float32) or on larger batches")


#: A row's class by how many times the batch read it.
CLASSES = ("absent", "present", "repeated")


@dataclass(frozen=True)
class RowProfile:
    """Each row of one case's dE: its error and each path's size, over the row's bound."""

    error: np.ndarray  # [V] max |dE - reference| / bound
    input_path: np.ndarray  # [V] max |dE_in| / bound
    output_path: np.ndarray  # [V] max |dE_out| / bound
    reads: np.ndarray  # [V] how many times the batch read the row (0: absent)
    wrong: frozenset[int]  # the rows the diagnosis found wrong

    @property
    def V(self) -> int:
        return int(self.error.shape[0])

    def row_class(self, row: int) -> str:
        return CLASSES[min(2, int(self.reads[row]))]


@dataclass
class CaseResult:
    """Outcome of one case: a diagnosis, or the adapter error that prevented one."""

    case: Case
    status: Status
    diagnosis: Diagnosis | None = None
    error: str | None = None
    mutated: tuple[str, ...] = ()
    shrunk: Case | None = None
    replay: str = ""
    stage: Stage = FIRST_CALL  # which call the diagnosis is of (models are called twice)
    precision: str | None = None  # what it was judged at
    precision_note: str = ""  # why, when not the dtype it returned (see observe.judged_precision)
    shrink_note: str = ""  # why shrinking stopped early, if it did
    # each row's error and paths over its bound (``--html``), or why they are not drawn
    rows: RowProfile | str | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        c = self.case
        d: dict[str, Any] = {
            "name": c.name, "seed": c.seed, "V": c.V, "d": c.d, "N": c.N, "res": c.res,
            "s_in": c.s_in, "bias": c.bias, "dtype": c.dtype, "status": self.status,
            "error": self.error, "mutated_inputs": list(self.mutated), "replay": self.replay,
            "stage": self.stage, "precision": self.precision,
            "margin": None if self.diagnosis is None else self.diagnosis.margin,
        }
        if self.diagnosis is not None:
            dd = self.diagnosis.as_dict()
            d.update({k: dd[k] for k in ("label", "detail", "rows_total", "rows_wrong",
                                         "rows_exact", "wrong_rows", "max_abs_error",
                                         "max_rel_error", "power", "rows_compared")})
            d["diagnosis"] = dd
        if self.shrunk is not None:
            d["smallest_batch"] = {"tokens": list(self.shrunk.tokens or ()),
                                   "targets": list(self.shrunk.targets or ()),
                                   "shape": [self.shrunk.V, self.shrunk.d, self.shrunk.N]}
        if self.shrink_note:
            d["shrink_note"] = self.shrink_note
        return d


@dataclass
class CheckReport:
    """All case results for one target, and the overall verdict and exit status."""

    target: str
    kind: str
    seed: int
    results: list[CaseResult] = field(default_factory=list)
    load_error: str | None = None
    precision: str = "auto"
    notes: list[str] = field(default_factory=list)
    quick: Quick | None = None  # a quick check (``--quick``): what it left out

    @property
    def verdict(self) -> str:
        if any(r.status == "wrong" for r in self.results):  # exit 1 whenever a case proves it
            return "wrong"
        if self.load_error or any(r.status == "adapter_error" for r in self.results):
            return "adapter_error"
        if self.results and all(r.status == "no_power" for r in self.results):
            return "no_power"
        return "correct"

    @property
    def exit_code(self) -> int:
        """0 correct, 1 a wrong gradient (and nothing else), 2 a usage or adapter error, and
        ``EXIT_NO_POWER`` (77) when no case had the power to decide (see its comment above)."""
        return EXIT_STATUS[self.verdict]

    @property
    def ok(self) -> bool:
        """Every case reached a verdict and each was correct (what exit status 0 means)."""
        return self.exit_code == 0

    @property
    def cases(self) -> list[CaseResult]:
        """The case results, in the order they ran."""
        return self.results

    @property
    def diagnosis(self) -> str:
        """The report as a person reads it: the verdict and its label first, then each case
        (what ``tyingspec check`` prints)."""
        label = self.diagnosis_label
        head = f"{self.target} (--kind {self.kind}): {self.verdict}" + (
            f" ({label})" if label != self.verdict else "")
        return head + "\n" + render(self)

    def raise_for_failure(self) -> None:
        """Raise :class:`CheckFailed` (an ``AssertionError``, so pytest shows it as a test
        failure) whose message is :attr:`diagnosis`, unless the report is :attr:`ok`; for a run
        in which no case had the power to decide (``verdict == "no_power"``), its subclass
        :class:`NoPower`."""
        if self.verdict == "no_power":
            raise NoPower(self)
        if not self.ok:
            raise CheckFailed(self)

    @property
    def diagnosis_label(self) -> str:
        labels = [r.diagnosis.label for r in self.results
                  if r.diagnosis is not None and r.status == "wrong"]
        if not labels:
            return self.verdict
        return run_label(labels)


class CheckFailed(TyingspecError, AssertionError):
    """A check that did not pass: the message is the rendered diagnosis; ``report`` holds
    every case."""

    def __init__(self, report: CheckReport, message: str | None = None) -> None:
        super().__init__(report.diagnosis if message is None else message)
        self.report = report


class NoPower(CheckFailed):
    """A check in which no case had the power to decide (``verdict == "no_power"``): not a
    wrong gradient, and not a pass either (the command exits ``EXIT_NO_POWER``, 77).  The
    message says so first, then the rendered diagnosis; catch it before :class:`CheckFailed`
    to tell the two apart."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report, f"{no_power_text('case')}\n{report.diagnosis}")


@dataclass(frozen=True)
class Quick:
    """What a quick check ran of the full one: ``run`` of ``total`` cases, and the kind's own
    checks it ran (None: all of them)."""

    run: int
    total: int
    checks: tuple[str, ...] | None

    def text(self) -> str:
        """The line a report marks a quick check with."""
        return f"quick: {self.run} of {self.total} cases; not a full check"

    def as_dict(self) -> dict[str, Any]:
        return {"cases_run": self.run, "cases_total": self.total,
                "checks": None if self.checks is None else list(self.checks)}


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
