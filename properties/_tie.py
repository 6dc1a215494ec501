"""The tie after an optimizer step: one matrix, not two copies that started equal."""

from __future__ import annotations

from tyingspec._cases import SGD_STEP, Case, build, closed_form, sgd_step
from tyingspec._diagnosis import diagnose
from tyingspec._strategies import cases

from ._common import Adapter, concrete, dE_scale, judged_dtype, run_model
from ._core import PropertyFailure, discard, register, require_power


@register("tie_survives_a_step", "ID", ("model",), lambda: cases())
def tie_survives_a_step(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """After one SGD step the tie still holds: call the model at E, step E <- E - lr*dE with the
    dE it returned (W and b unchanged), call it again at the stepped E: the second gradient is
    the tied reference at the stepped E.  A model whose "tie" is a copy made at initialisation
    (equal at step 0, each copy stepped with its own gradient) fails here.  Contract for a
    stateful adapter: the E it is called with is the current tied matrix; W and b unchanged
    identify the same model instance."""
    batch = build(case)
    first = run_model(spec, fn, batch)
    step = sgd_step(batch, first.dE)
    if step is None:
        discard("the returned gradient is zero: the step would not move E")
    stepped, lr = step
    second = run_model(spec, fn, stepped)
    paths = closed_form(stepped)
    diag = diagnose(second.dE, paths, dtype=judged_dtype(case, second.dE),
                    scale=dE_scale(stepped))
    require_power(diag)
    if diag.wrong:
        raise PropertyFailure(
            "tie_survives_a_step", "after one SGD step the gradient is no longer the tied one",
            concrete(case, batch), diagnosis=diag,
            details=f"step: E <- E - {lr:.6g} * dE (largest entry moved by {SGD_STEP}); diagnosis "
                    "of the call at the stepped E against the tied reference there")
