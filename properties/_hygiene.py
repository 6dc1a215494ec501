"""Hygiene: an implementation leaves its inputs alone and does not remember earlier calls."""

from __future__ import annotations

from typing import Any

import numpy as np

from tyingspec._cases import Case, build, closed_form
from tyingspec._diagnosis import diagnose
from tyingspec._strategies import cases

from ._common import (
    Adapter,
    agree,
    concrete,
    dE_scale,
    judged_dtype,
    kernel_case,
    natural_scales,
    run_model,
)
from ._core import PropertyFailure, register


@register("inputs_untouched", "PURE", ("model", "kernel"), lambda: cases())
def inputs_untouched(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """The implementation does not write into any array it is given (E, W, b, tokens, targets
    for a model; tokens, dx, h, g for a kernel): compared bitwise, since any write is a
    mutation even when it writes back equal values."""
    batch = build(case)
    paths = closed_form(batch)
    if kind == "kernel":
        k, _, _ = kernel_case(batch)
        dE, mutated = k.call(spec, fn)
    else:
        out = run_model(spec, fn, batch)
        dE, mutated = out.dE, out.mutated
    if mutated:
        diag = diagnose(dE, paths, dtype=judged_dtype(case, dE), mutated=mutated,
                        scale=dE_scale(batch))
        raise PropertyFailure("inputs_untouched", "wrote into its inputs: " + ", ".join(mutated),
                              concrete(case, batch), diagnosis=diag)


def _outputs(spec: str, fn: Adapter, kind: str, batch: Any) -> dict[str, Any]:
    if kind == "kernel":
        k, _, _ = kernel_case(batch)
        return {"dE": k.call(spec, fn)[0]}
    out = run_model(spec, fn, batch)
    return {"loss": out.loss, "dE": out.dE, "dW": out.dW, "db": out.db}


@register("same_call_same_gradient", "FRESH", ("model", "kernel"), lambda: cases())
def same_call_same_gradient(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """Calling the implementation twice on the same inputs gives the same outputs (dE, and for a
    model the loss, dW and db): no gradient buffer, cache or random state leaks from one call
    into the next.  Compared under the dtype's atol and rtol, not bitwise: a scatter with
    atomics may legitimately sum in a different order each call; a leaked buffer is off by a
    whole gradient."""
    batch = build(case)
    first = _outputs(spec, fn, kind, batch)
    second = _outputs(spec, fn, kind, batch)
    paths = closed_form(batch)
    dtype = judged_dtype(case, *[v for v in first.values() if isinstance(v, np.ndarray)])
    scales = natural_scales(batch)
    differ = [k for k, v in first.items()
              if v is not None and not agree(second[k], v, dtype, scales[k]).all()]
    if differ:
        diag = diagnose(second["dE"], paths, dtype=dtype, scale=scales["dE"])
        raise PropertyFailure("same_call_same_gradient",
                              "the second identical call returned different " + ", ".join(differ),
                              concrete(case, batch), diagnosis=diag,
                              details="diagnosis of the second call's dE")
