"""The distributed kind's properties: a user's own ``torch.distributed`` step, one invariant
each.

Each draws a batch composition (its shape is the target's own: vocabulary, width, batch x
sequence) and observes the target once through the engine; one call runs every layout the
target declares on its live worlds and every check, and each property asserts its own.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Observation, Target, observe, own_case

from ._core import PropertyFailure, register

#: Compositions a target's fixed shape can always hold.
COMPOSITIONS = ("random", "distinct", "repeats", "one-token", "with-zero", "no-zero", "sparse")


def distributed_cases() -> st.SearchStrategy[Case]:
    """A composition and a seed; V, d and N are the target's (set when the case is run)."""
    return cases(max_vocab=48, min_vocab=8, dtypes=("float64",), compositions=COMPOSITIONS,
                 degenerate=False)


def _hold(prop: str, target: Target, case: Case, check: str) -> Observation:
    o = observe(target, own_case(target, case))
    bad = [f for f in o.diagnosis.findings if f.failed and f.check == check]
    if bad:
        f = bad[0]
        diag = replace(o.diagnosis, label=f.label or "unknown", detail=f"{f.check}: {f.detail}")
        raise PropertyFailure(prop, f"{f.check}: {f.invariant} does not hold", o.case,
                              diagnosis=diag)
    return o


@register("distributed_copies_equal_at_start", "ID", distributed_cases)
def distributed_copies_equal_at_start(target: Target, case: Case) -> None:
    """Every rank that holds a copy of the tied matrix holds the reference's E before the
    step (a last stage's copy initialised on its own, never synced, fails)."""
    _hold("distributed_copies_equal_at_start", target, case, "copies equal at start")


@register("distributed_gradient_after_sync", "SUM", distributed_cases)
def distributed_gradient_after_sync(target: Target, case: Case) -> None:
    """After the user's sync, every copy's gradient equals the single-process tied gradient
    row by row: the input and output paths of every micro-batch of every DP replica."""
    _hold("distributed_gradient_after_sync", target, case, "gradient after the sync")


@register("distributed_copies_equal_after_step", "ID", distributed_cases)
def distributed_copies_equal_after_step(target: Target, case: Case) -> None:
    """Every copy of the tied matrix is equal after the optimizer step."""
    _hold("distributed_copies_equal_after_step", target, case, "copies equal after the step")
