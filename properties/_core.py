"""The property contract: a named invariant, the examples it draws, and a check that can fail.

A property's ``check(fn, spec, kind, case)`` calls the adapter ``fn`` (resolved from ``spec``)
on the case and raises :class:`PropertyFailure` when the invariant is broken; it raises
:class:`tyingspec.AdapterError` when the adapter itself misbehaves (not a wrong gradient), and
calls ``hypothesis.assume(False)`` (via :func:`require_power`) when the example could not have
told a broken implementation from a correct one, so it is not counted as evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn

from hypothesis import assume, currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from tyingspec._src.core.cases import Case
from tyingspec._src.core.diagnosis import UNINFORMATIVE, Diagnosis
from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.kind import Kind, KindSpec
from tyingspec._src.core.render import batch_lines, diagnosis_lines
from tyingspec._src.engine.observe import Observation, Target
from tyingspec._src.kinds.table import KINDS, kind_spec

#: A property's check: raises PropertyFailure when the invariant is broken for ``target`` on
#: ``case``, AdapterError when the adapter misbehaves, discards a powerless example.
Check = Callable[[Target, Case], None]


class PropertyFailure(TyingspecError, AssertionError):
    """An invariant does not hold: the message puts the diagnosis first, then the batch."""

    def __init__(self, prop: str, headline: str, case: Case, *,
                 diagnosis: Diagnosis | None = None, details: str = "",
                 stage: str = "first call") -> None:
        self.prop, self.headline, self.case = prop, headline, case
        self.diagnosis, self.details, self.stage = diagnosis, details, stage
        super().__init__("\n".join(self.lines(indent="")))

    def lines(self, indent: str = "  ") -> list[str]:
        """Diagnosis first, then the property's own details, then the batch."""
        out = [f"property {self.prop} does not hold: {self.headline}"]
        if self.diagnosis is not None:
            out += diagnosis_lines(self.diagnosis, stage=self.stage, indent=indent)
        if self.details:
            out.append(indent + self.details)
        return out + ["batch:", *batch_lines(self.case, indent=indent or "  ")]

    @property
    def label(self) -> str:
        return self.diagnosis.label if self.diagnosis is not None else "property_violated"


@dataclass(frozen=True)
class Property:
    """One invariant: its name, the catalogue invariant it guards, the kinds it applies to."""

    name: str
    invariant: str
    doc: str
    strategy: Callable[[], st.SearchStrategy[Case]]
    check: Check

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds whose entry in the kind table lists this property."""
        return tuple(k for k, spec in KINDS.items() if self.name in spec.properties)


PROPERTIES: dict[str, Property] = {}


def register(name: str, invariant: str,
             strategy: Callable[[], st.SearchStrategy[Case]]) -> Callable[[Check], Check]:
    """Decorator: register ``check`` as property ``name``; its docstring states the invariant."""

    def deco(check: Check) -> Check:
        if name in PROPERTIES:
            raise ValueError(f"property {name!r} registered twice")
        PROPERTIES[name] = Property(name, invariant, (check.__doc__ or "").strip(), strategy,
                                    check)
        return check

    return deco


def require_power(diag: Diagnosis) -> None:
    """Discard an example whose verdict is ``no_power`` (recorded as an event): it could not
    have caught a dropped path, so it is not evidence either way.  A wrong verdict is never
    discarded: ``tyingspec check`` would report it, and so does the property."""
    if diag.label == "no_power":
        discard("no power (a dropped path would pass on this example)")


def require_rows(prop: str, o: Observation) -> None:
    """The rows' own verdict of an observation whose label a named check may have decided
    (the torch and linear-ce kinds): pass, discard without power, or fail with the rows'
    label (and the diagnosis as it is when that label is also the observation's)."""
    diag = o.diagnosis
    label = diag.rows_label or diag.label
    if label in ("correct", "no_power"):
        require_power(replace(diag, label=label))
        return
    if label != diag.label:
        diag = replace(diag, label=label, detail="")
    raise PropertyFailure(prop, "the tied gradient is not the sum of its two paths", o.case,
                          diagnosis=diag)


def discard(reason: str) -> NoReturn:
    """Reject an example that cannot be evidence (``hypothesis.assume(False)``), recording the
    reason as a Hypothesis event inside a test; called directly, it raises
    ``hypothesis.errors.UnsatisfiedAssumption``."""
    if not currently_in_test_context():  # assume() outside a test is deprecated in Hypothesis
        raise UnsatisfiedAssumption(f"discarded: {reason}")
    event(f"discarded: {reason}")
    assume(False)
    raise UnsatisfiedAssumption(f"discarded: {reason}")  # not reached: assume(False) raises


def for_kind(kind: Kind | KindSpec) -> list[Property]:
    """The properties that apply to ``kind``, as its entry in the kind table lists them.  A
    public signature: a kind's name is looked up here, at that boundary."""
    table = kind if isinstance(kind, KindSpec) else kind_spec(kind)
    return [PROPERTIES[name] for name in table.properties]


def label_locked(check: Check) -> Check:
    """``check`` for one Hypothesis run in which every failure keeps the first failure's
    diagnosis label: shrinking then ends at the smallest batch *with that diagnosis*, not at a
    batch so small that two bugs look alike (one present row hides a padding mask behind
    "input path missing").  Examples failing with another label are discarded, not passed.

    A first label that names no bug (``unknown``, ``no_power``: e.g. every row present, so the
    rows cannot say which path is wrong) is not kept: the lock moves once, to the first
    informative label a failure shows, and never back, so shrinking goes on to a batch that
    names the bug instead of keeping batches that cannot.  A batch that failed before the move
    keeps failing as it did: Hypothesis replays its smallest failure at the end, and a replay
    that no longer fails would be reported as flaky."""
    lock: list[str] = []
    before_move: set[Case] = set()  # failures accepted under an uninformative lock

    def locked(target: Target, case: Case) -> None:
        try:
            check(target, case)
        except PropertyFailure as exc:
            if not lock:
                lock.append(exc.label)
            elif exc.label != lock[0]:
                if lock[0] in UNINFORMATIVE and exc.label not in UNINFORMATIVE:
                    lock[0] = exc.label
                elif case not in before_move:
                    discard(f"shrinking keeps the diagnosis {lock[0]} (this batch: "
                            f"{exc.label})")
            if lock[0] in UNINFORMATIVE:
                before_move.add(case)
            raise

    return locked
