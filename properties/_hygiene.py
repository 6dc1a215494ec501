"""Hygiene: an implementation leaves its inputs alone and does not remember earlier calls."""

from __future__ import annotations

import numpy as np

from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import (
    Target,
    agree,
    batch_for,
    call,
    judge,
    judge_repeat,
    precision_for,
    reference,
)

from ._core import PropertyFailure, register


@register("inputs_untouched", "PURE", lambda: cases())
def inputs_untouched(target: Target, case: Case) -> None:
    """The implementation does not write into any array it is given (E, W, b, tokens, targets
    for a model; tokens, dx, h, g for a kernel): compared bitwise, since any write is a
    mutation even when it writes back equal values."""
    case, batch = batch_for(target, case)
    got = call(target, batch)
    if got.mutated:
        diag = judge(got, reference(target, batch), precision_for(target, got))
        raise PropertyFailure("inputs_untouched", "wrote into its inputs: "
                              + ", ".join(got.mutated),
                              case, diagnosis=diag)


def _values(r: Returned) -> dict[str, object]:
    return {"dE": r.dE, "loss": r.loss, "dW": r.dW, "db": r.db}


@register("same_call_same_gradient", "FRESH", lambda: cases())
def same_call_same_gradient(target: Target, case: Case) -> None:
    """Calling the implementation twice on the same inputs gives the same outputs (dE, and for a
    model the loss, dW and db): no gradient buffer, cache or random state leaks from one call
    into the next.  Compared within the rounding bound, not bitwise: a scatter with atomics may
    legitimately sum in a different order each call; a leaked buffer is off by a whole
    gradient."""
    case, batch = batch_for(target, case)
    first, second = call(target, batch), call(target, batch)
    paths = reference(target, batch)
    precision = precision_for(target, first, second)
    a, b = _values(first), _values(second)
    differ = [k for k, v in a.items()
              if v is not None and not agree(k, b[k], v, paths, precision).all()]
    if differ:
        diag = judge_repeat(first, second, paths, precision)
        gap = float(np.max(np.abs(np.asarray(second.dE, np.float64)
                                  - np.asarray(first.dE, np.float64)), initial=0.0))
        raise PropertyFailure("same_call_same_gradient",
                              "the second identical call returned different " + ", ".join(differ),
                              case, diagnosis=diag,
                              details="diagnosis of the second call's dE; the two calls' dE "
                                      f"differ by up to {gap:.3g}")
