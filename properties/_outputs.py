"""The model's other outputs: the loss, dW and db."""

from __future__ import annotations

from tyingspec._cases import Case, build
from tyingspec._diagnosis import diagnose
from tyingspec._strategies import cases

from ._common import Adapter, concrete, dE_scale, judged_dtype, other_checks, run_model
from ._core import PropertyFailure, register
from ._gradients import reference


@register("loss_dW_db_right", "OUT", ("model",), lambda: cases())
def loss_dW_db_right(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """The loss, dW and db a model returns equal the reference (sympy on small shapes, closed
    form on larger ones) under the dtype's atol and rtol, atol anchored on the sizes these
    gradients can reach (so an exact 0 is not failed for rounding noise); db is None exactly
    when b is."""
    batch = build(case)
    out = run_model(spec, fn, batch)
    paths = reference(batch)
    dtype = judged_dtype(case, out.dE, out.dW, out.db)
    checks = other_checks(out, paths, dtype, batch)
    bad = [c for c in checks if not c.ok]
    if bad:
        raise PropertyFailure(
            "loss_dW_db_right", "wrong " + ", ".join(c.name for c in bad), concrete(case, batch),
            diagnosis=diagnose(out.dE, paths, dtype=dtype, others=checks,
                               scale=dE_scale(batch)),
            details="; ".join(c.describe() for c in bad))
