"""One named check of a target's behaviour beyond its gradient rows, and what it found.

The torch kind runs checks no row comparison can express (is the tie one Parameter after a
state-dict round trip? does the optimizer see it once? do micro-batches add up?).  Each comes
back as a :class:`Finding` from the worker: plain data, so it crosses the process boundary and
renders the same in the report, the JSON and a pytest failure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from tyingspec._src.core.labels import Label

#: ``passed``; ``failed`` (the label says what is wrong); ``not_applicable`` (the model has no
#: such feature, e.g. no ``resize_token_embeddings``; the detail says why).
Outcome = Literal["passed", "failed", "not_applicable"]


@dataclass(frozen=True)
class Finding:
    """One check: its name, the invariant it guards, the outcome and what was seen."""

    check: str  # e.g. "identity after load_state_dict(assign=True)"
    invariant: str  # one sentence: what must hold
    outcome: Outcome
    detail: str = ""
    label: Label | None = None  # set when failed
    evaluations: int = 0  # forward evaluations spent (directional differences)
    # a passing gradient check shown to have power: the same check fails the gradient with its
    # input path removed (a low-precision model's rows may not be able to tell)
    power: bool = False

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The one line a report prints for this check."""
        mark = {"passed": "ok", "failed": "FAILED", "not_applicable": "n/a"}[self.outcome]
        tail = f": {self.detail}" if self.detail else ""
        return f"{self.check}: {mark}{tail}"


def passed(check: str, invariant: str, detail: str = "", evaluations: int = 0,
           power: bool = False) -> Finding:
    return Finding(check, invariant, "passed", detail, None, evaluations, power)


def failed(check: str, invariant: str, label: Label, detail: str,
           evaluations: int = 0) -> Finding:
    return Finding(check, invariant, "failed", detail, label, evaluations)


def not_applicable(check: str, invariant: str, why: str) -> Finding:
    return Finding(check, invariant, "not_applicable", why)


#: The check a kind reports as not applicable when a use of the tie cannot be observed (a
#: detached lookup, a custom Function): its rows are then the target's own gradient, split as
#: its backward split it, so comparing them with itself is no evidence, and the forward check
#: judges them instead.
BY_PATH = "gradient by path"
BY_PATH_INVARIANT = ("the tied gradient is the input path's scatter-add of dx plus the output "
                     "path's g.T @ h, row by row")


def uses_unobserved(why: str) -> Finding:
    """The :data:`BY_PATH` finding of a call whose uses of the tie could not be observed."""
    return not_applicable(BY_PATH, BY_PATH_INVARIANT, why)


def rows_unobserved(findings: tuple[Finding, ...] | list[Finding]) -> bool:
    """Whether a call's rows are its own (see :data:`BY_PATH`), not a reference's."""
    return any(f.check == BY_PATH and f.outcome == "not_applicable" for f in findings)
