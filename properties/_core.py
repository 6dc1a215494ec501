"""The property contract: a named invariant, the examples it draws, and a check that can fail.

A property's ``check(fn, spec, kind, case)`` calls the adapter ``fn`` (resolved from ``spec``)
on the case and raises :class:`PropertyFailure` when the invariant is broken; it raises
:class:`tyingspec.AdapterError` when the adapter itself misbehaves (not a wrong gradient), and
calls ``hypothesis.assume(False)`` (via :func:`require_power`) when the example could not have
told a broken implementation from a correct one, so it is not counted as evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from hypothesis import assume, currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from tyingspec._cases import Case
from tyingspec._diagnosis import Diagnosis

Check = Callable[[Callable[..., Any], str, str, Case], None]


class PropertyFailure(AssertionError):
    """An invariant does not hold: the message puts the diagnosis first, then the batch."""

    def __init__(self, prop: str, headline: str, case: Case, *,
                 diagnosis: Diagnosis | None = None, details: str = "") -> None:
        self.prop, self.headline, self.case = prop, headline, case
        self.diagnosis, self.details = diagnosis, details
        lines = [f"property {prop} does not hold: {headline}"]
        if diagnosis is not None:
            lines.append(f"diagnosis: {diagnosis.headline()}")
            lines.append(f"rows: {diagnosis.rows_wrong} wrong of {diagnosis.rows_total}; "
                         f"wrong rows {diagnosis.wrong_rows[:16]}"
                         + (" ..." if len(diagnosis.wrong_rows) > 16 else ""))
        if details:
            lines.append(details)
        lines.append(f"batch: {case.describe()} tokens={list(case.tokens or ())} "
                     f"targets={list(case.targets or ())}")
        super().__init__("\n".join(lines))

    @property
    def label(self) -> str:
        return self.diagnosis.label if self.diagnosis is not None else "property_violated"


@dataclass(frozen=True)
class Property:
    """One invariant: its name, the catalogue invariant it guards, the kinds it applies to."""

    name: str
    invariant: str
    doc: str
    kinds: tuple[str, ...]
    strategy: Callable[[], st.SearchStrategy[Case]]
    check: Check


PROPERTIES: dict[str, Property] = {}


def register(name: str, invariant: str, kinds: tuple[str, ...],
             strategy: Callable[[], st.SearchStrategy[Case]]) -> Callable[[Check], Check]:
    """Decorator: register ``check`` as property ``name``; its docstring states the invariant."""

    def deco(check: Check) -> Check:
        if name in PROPERTIES:
            raise ValueError(f"property {name!r} registered twice")
        PROPERTIES[name] = Property(name, invariant, (check.__doc__ or "").strip(), kinds,
                                    strategy, check)
        return check

    return deco


def require_power(diag: Diagnosis, *, input_path: bool = True, output_path: bool = True) -> None:
    """Discard an example that could not have caught a dropped path (recorded as an event)."""
    if (input_path and not diag.power.input_path) or (output_path and not diag.power.output_path):
        discard("no power (a dropped path would pass on this example)")


def discard(reason: str) -> NoReturn:
    """Reject an example that cannot be evidence (``hypothesis.assume(False)``), recording the
    reason as a Hypothesis event inside a test; called directly, it raises
    ``hypothesis.errors.UnsatisfiedAssumption``."""
    if not currently_in_test_context():  # assume() outside a test is deprecated in Hypothesis
        raise UnsatisfiedAssumption(f"discarded: {reason}")
    event(f"discarded: {reason}")
    assume(False)
    raise UnsatisfiedAssumption(f"discarded: {reason}")  # not reached: assume(False) raises


def for_kind(kind: str) -> list[Property]:
    return [p for p in PROPERTIES.values() if kind in p.kinds]
