"""Central differences of the probe model's loss, on every entry (an oracle for small shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tyingspec._src.core.paths import Array, IntArray, flatten_batch, loss_only


@dataclass(frozen=True)
class NumericGradients:
    loss: float
    dE: Array
    dW: Array
    db: Array | None


def _central(f: object, a: Array, step: float) -> Array:
    grad = np.zeros_like(a, dtype=np.float64)
    flat = a.reshape(-1)
    gflat = grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + step
        up = f()  # type: ignore[operator]
        flat[i] = keep - step
        down = f()  # type: ignore[operator]
        flat[i] = keep
        gflat[i] = (up - down) / (2 * step)
    return grad


def central_differences(
    E: Array,
    W: Array,
    b: Array | None,
    tokens: object,
    targets: object,
    res: float = 1.0,
    s_in: float = 1.0,
    *,
    step: float = 1e-6,
) -> NumericGradients:
    """dL/dE (tied: both uses perturbed together), dL/dW, dL/db by central differences, float64."""
    t, y = flatten_batch(tokens, targets)
    E = np.array(E, dtype=np.float64)
    W = np.array(W, dtype=np.float64)
    b = None if b is None else np.array(b, dtype=np.float64)

    def f() -> float:
        return loss_only(E, E, W, b, t, y, res, s_in)

    return NumericGradients(
        loss=f(),
        dE=_central(f, E, step),
        dW=_central(f, W, step),
        db=None if b is None else _central(f, b, step),
    )


def central_difference_entry(
    E: Array, W: Array, b: Array | None, tokens: IntArray, targets: IntArray,
    res: float, s_in: float, row: int, col: int, *, step: float = 1e-6,
) -> float:
    """One entry of dL/dE by central differences (for sampled-entry gradient checks)."""
    E = np.array(E, dtype=np.float64)
    keep = E[row, col]
    E[row, col] = keep + step
    up = loss_only(E, E, W, b, tokens, targets, res, s_in)
    E[row, col] = keep - step
    down = loss_only(E, E, W, b, tokens, targets, res, s_in)
    return (up - down) / (2 * step)
