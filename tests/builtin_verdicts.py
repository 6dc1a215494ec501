"""What the tests that hold the probe zoo to the same verdicts under another way of judging
share: each built-in's verdict, case by case, on the standard cases at a small shape."""

from __future__ import annotations

from tyingspec._src.core.cases import at_shape, standard_cases
from tyingspec._src.front.check import check_target
from tyingspec._src.kinds.probe.builtins import builtins
from tyingspec._src.kinds.probe.mutants import reset_state

Verdict = tuple[str, str, "str | None", "str | None"]  # case, status, label, stage


def names(kind: str) -> list[str]:
    """The built-ins that have a ``kind`` form, sorted."""
    return sorted(n for n, impl in builtins().items() if getattr(impl, kind) is not None)


def labels(kind: str, name: str) -> list[Verdict]:
    """The built-in ``name``'s verdict on every standard case at V=160, d=12, N=24."""
    reset_state()
    cases, _ = at_shape(standard_cases(0), 160, 12, 24)
    report = check_target(name, kind, 0, cases, shrink_budget=0)
    return [(r.case.name, r.status, None if r.diagnosis is None else r.diagnosis.label,
             r.stage) for r in report.results]
