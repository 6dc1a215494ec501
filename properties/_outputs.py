"""The model's other outputs: the loss, dW and db."""

from __future__ import annotations

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Target, first_call

from ._core import PropertyFailure, register


@register("loss_dW_db_right", "OUT", lambda: cases())
def loss_dW_db_right(target: Target, case: Case) -> None:
    """The loss, dW and db a model returns equal the reference (sympy on small shapes, closed
    form on larger ones) within their rounding bounds; db is None exactly when b is."""
    o = first_call(target, case)
    bad = [c for c in o.diagnosis.others if not c.ok]
    if bad:
        raise PropertyFailure(
            "loss_dW_db_right", "wrong " + ", ".join(c.name for c in bad), o.case,
            diagnosis=o.diagnosis, details="; ".join(c.describe() for c in bad))
