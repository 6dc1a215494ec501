"""The tie after an optimizer step: one matrix, not two copies that started equal."""

from __future__ import annotations

from tyingspec._src.core.cases import SGD_STEP, Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import AFTER_STEP, Target, observe

from ._core import PropertyFailure, register


@register("tie_survives_a_step", "ID", lambda: cases())
def tie_survives_a_step(target: Target, case: Case) -> None:
    """After one SGD step the tie still holds: call the model at E, step E <- E - lr*dE with the
    dE it returned (W and b unchanged), call it again at the stepped E: the second gradient is
    the tied reference at the stepped E.  A model whose "tie" is a copy made at initialisation
    (equal at step 0, each copy stepped with its own gradient) fails here, and so does one whose
    gradient buffer is never zeroed.  Contract for a stateful adapter: the E it is called with
    is the current tied matrix; W and b unchanged identify the same model instance."""
    o = observe(target, case)
    if o.stage != AFTER_STEP:
        if o.diagnosis.wrong:
            # Wrong before any step: the tie was never put to the test.  Discarding this
            # example (as it once did) discarded every example of a gradient wrong from the
            # first call, and Hypothesis then failed the run with FailedHealthCheck, blamed on
            # the tie.  The verdict is the first call's diagnosis, as sum_of_paths reports it.
            raise PropertyFailure(
                "tie_survives_a_step", "the first call is already wrong, before any step: "
                "dE != dE_in + dE_out", o.case, diagnosis=o.diagnosis, stage=o.stage,
                details="no step was taken from a wrong gradient, so the tie itself was not "
                        "tested (sum_of_paths fails on the same call)")
        return
    raise PropertyFailure(
        "tie_survives_a_step", "after one SGD step the gradient is no longer the tied one",
        o.case, diagnosis=o.diagnosis, stage=o.stage,
        details=f"step: E <- E - lr * dE (largest entry moved by {SGD_STEP}); diagnosis of the "
                "call at the stepped E against the tied reference there")
