"""The tie after an optimizer step: one matrix, not two copies that started equal."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tyingspec._cases import Case, build
from tyingspec._diagnosis import diagnose
from tyingspec._probe import closed_form_paths
from tyingspec._strategies import cases

from ._common import Adapter, concrete, dE_scale, judged_dtype, run_model
from ._core import PropertyFailure, discard, register, require_power

#: The SGD step moves the entry of E with the largest gradient by this much.
STEP = 0.1


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
    dE0 = np.asarray(first.dE, dtype=np.float64)
    peak = float(np.max(np.abs(dE0))) if dE0.size else 0.0
    if peak == 0.0:
        discard("the returned gradient is zero: the step would not move E")
    lr = STEP / peak
    E1 = (batch.E.astype(np.float64) - lr * dE0).astype(batch.E.dtype)
    second = run_model(spec, fn, batch, E=E1)
    paths = closed_form_paths(E1.astype(np.float64), batch.W.astype(np.float64),
                              None if batch.b is None else batch.b.astype(np.float64),
                              batch.tokens, batch.targets, batch.res, batch.s_in)
    stepped = replace(batch, E=E1)
    diag = diagnose(second.dE, paths, dtype=judged_dtype(case, second.dE),
                    scale=dE_scale(stepped))
    require_power(diag)
    if diag.wrong:
        raise PropertyFailure(
            "tie_survives_a_step", "after one SGD step the gradient is no longer the tied one",
            concrete(case, batch), diagnosis=diag,
            details=f"step: E <- E - {lr:.6g} * dE (largest entry moved by {STEP}); diagnosis "
                    "of the call at the stepped E against the tied reference there")
