"""The torch kind's properties: a user's own ``nn.Module``, one invariant each.

Each draws a batch composition (its shape is the model's own: vocabulary, width, batch x
context) and observes the model once through the engine; the call runs every check, and each
property asserts its own.  Identity and optimizer checks do not depend on the batch and run once
per worker process.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from tyingspec._src.core.cases import Case
from tyingspec._src.core.findings import Finding
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Observation, Target, observe, own_case

from ._core import PropertyFailure, register, require_power, require_rows

#: Compositions a model's fixed shape can always hold (N may exceed V: no "distinct" there).
TORCH_COMPOSITIONS = ("random", "distinct", "repeats", "one-token", "with-zero", "no-zero",
                      "sparse")


def torch_cases() -> st.SearchStrategy[Case]:
    """A composition and a seed; V, d and N are the model's (set when the case is run)."""
    return cases(max_vocab=48, min_vocab=8, dtypes=("float64",),
                 compositions=TORCH_COMPOSITIONS, degenerate=False)


def _observed(target: Target, case: Case, *checks: str) -> Observation:
    # only this property's checks run (the rows are observed on every call)
    return observe(target, own_case(target, case), checks=checks)


def _fail_on(prop: str, o: Observation, prefixes: tuple[str, ...]) -> None:
    bad: list[Finding] = [f for f in o.diagnosis.findings
                          if f.failed and f.check.startswith(prefixes)]
    if bad:
        f = bad[0]
        diag = replace(o.diagnosis, label=f.label or "unknown", detail=f"{f.check}: {f.detail}")
        raise PropertyFailure(prop, f"{f.check}: {f.invariant} does not hold", o.case,
                              diagnosis=diag)


@register("torch_tie_identity", "ID", torch_cases)
def torch_tie_identity(target: Target, case: Case) -> None:
    """The tied weights are one Parameter with one storage, at construction and after a deep
    copy, a dtype move, state-dict and safetensors round trips, assign=True loading and
    meta-device initialisation (each with the model's re-tie), a vocabulary resize and an
    optimizer step."""
    _fail_on("torch_tie_identity", _observed(target, case, "identity"),
             ("tie discovered", "identity"))


@register("torch_optimizer_sees_tie_once", "ID", torch_cases)
def torch_optimizer_sees_tie_once(target: Target, case: Case) -> None:
    """SGD, AdamW and the target's own optimizer hold the tied Parameter once, keep one state
    slot for it and move it by exactly one update per step."""
    _fail_on("torch_optimizer_sees_tie_once", _observed(target, case, "optimizer"),
             ("optimizer",))


@register("torch_gradient_by_path", "SUM", torch_cases)
def torch_gradient_by_path(target: Target, case: Case) -> None:
    """The tied Parameter's own gradient (the model's backward, hooks and custom Functions
    included) equals, row by row, the input path's scatter-add of dx plus the output path's
    g.T @ h, both observed at the tie's two uses in float64 (padding_idx honoured)."""
    o = _observed(target, case, "gradient")
    _fail_on("torch_gradient_by_path", o, ("tie discovered",))
    if (o.diagnosis.rows_label or o.diagnosis.label) != "no_power":
        require_rows("torch_gradient_by_path", o)
        return
    # Rows without power would be discarded.  Where the uses cannot be observed they are the
    # model's own and have none on any example, so every example was discarded and Hypothesis
    # failed the run with FailedHealthCheck, blamed on this property, whether the model was
    # right or wrong: the call's verdict then rests on the forward check, as the check's does.
    if not o.diagnosis.rows_compared:
        o = _observed(target, case, "gradient", "forward")
    if o.diagnosis.wrong:  # another check of this call says wrong: its diagnosis, not a discard
        raise PropertyFailure("torch_gradient_by_path",
                              "the tied gradient is not the sum of its two paths", o.case,
                              diagnosis=o.diagnosis)
    require_power(o.diagnosis)


@register("torch_gradient_against_forward", "SUM", torch_cases)
def torch_gradient_against_forward(target: Target, case: Case) -> None:
    """The tied gradient agrees with directional central differences of the loss: a backward
    wrong in both uses (a custom autograd.Function) cannot vouch for itself.  Rows are
    localised by group testing (O(k log V) forward pairs for k wrong rows)."""
    _fail_on("torch_gradient_against_forward", _observed(target, case, "forward"),
             ("gradient against the forward",))


@register("torch_fresh_gradient", "ACC", torch_cases)
def torch_fresh_gradient(target: Target, case: Case) -> None:
    """Two backward passes, each after zero_grad(), give the same tied gradient: no buffer
    behind it survives zeroing."""
    _fail_on("torch_fresh_gradient", _observed(target, case, "fresh"), ("fresh gradient",))


@register("torch_micro_batches_accumulate", "ACC", torch_cases)
def torch_micro_batches_accumulate(target: Target, case: Case) -> None:
    """k micro-batches (backward of loss / k each) sum to the gradient of one batch holding
    them all: the tied gradient is added to (`+=`), never assigned (`.grad =`)."""
    _fail_on("torch_micro_batches_accumulate", _observed(target, case, "micro_batches"),
             ("micro-batches accumulate",))
