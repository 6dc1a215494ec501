"""Properties of the tied gradient itself, checked against the two-path reference."""

from __future__ import annotations

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Target, observe

from ._core import PropertyFailure, register, require_power


@register("sum_of_paths", "SUM", lambda: cases())
def sum_of_paths(target: Target, case: Case) -> None:
    """The tied gradient equals input path + output path on every row, within each row's
    rounding bound (sympy reference on small shapes, closed form on larger ones); for a model,
    on the first call and again after one SGD step with the dE it returned.  This is exactly
    the verdict ``tyingspec check`` reaches on the same case."""
    o = observe(target, case)
    require_power(o.diagnosis)
    if o.diagnosis.wrong:
        raise PropertyFailure("sum_of_paths", "dE != dE_in + dE_out", o.case,
                              diagnosis=o.diagnosis, stage=o.stage)
