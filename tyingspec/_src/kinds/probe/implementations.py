"""Built-in implementations: the correct tied model and deliberately broken variants.

Each entry says which invariant it breaks (names from the bug catalogue: SUM, ROWS, DUP, SCALE,
ID, ...) and the diagnosis a checker should reach.  Most variants differ only in how they combine
the two paths, so one *combiner* ``(tokens, dx_rows, h, g, V) -> dE`` serves both as a kernel
adapter and, wrapped around the probe model's forward/backward, as a model adapter.
"""

from __future__ import annotations

from typing import Any

from tyingspec._src.core.paths import Array, IntArray, flatten_batch, forward_parts, scatter_rows
from tyingspec._src.kinds.probe.registry import (
    REGISTRY,
    Implementation,
    register,
    register_combiner,
)

__all__ = ["REGISTRY", "Implementation", "register", "untied_forward_backward"]

# --- correct -------------------------------------------------------------------------------

@register_combiner("tied", "hand-written numpy tied model: scatter-add (np.add.at) += g.T @ h",
                   None, "correct", "builtin")
def _tied(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    dE = g.T @ h
    dE += scatter_rows(tokens, dx, V)
    return dE


def untied_forward_backward(
    E: Array, U: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
    *, res: float = 1.0, s_in: float = 1.0,
) -> dict[str, Any]:
    """The untied twin: lookup matrix E, separate output matrix U; returns dE (lookup) and dU."""
    t, y = flatten_batch(tokens, targets)
    p = forward_parts(E, U, W, b, t, y, res, s_in)
    return {"loss": p.loss, "dE": scatter_rows(t, p.input_rows, E.shape[0]),
            "dU": p.g.T @ p.h, "dW": p.dW, "db": p.db}


def _untied_sum(
    E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
    *, res: float = 1.0, s_in: float = 1.0,
) -> dict[str, Any]:
    # Untying identity: the tied gradient is dL/dE_in + dL/dE_out evaluated at E_in = E_out = E.
    out = untied_forward_backward(E, E.copy(), W, b, tokens, targets, res=res, s_in=s_in)
    return {"loss": out["loss"], "dE": out["dE"] + out["dU"], "dW": out["dW"], "db": out["db"]}


register(Implementation(
    "untied-sum", "untied twin at U = E, returning dE + dU (the untying identity)",
    None, "correct", model=_untied_sum, tags=("builtin",)))


# --- broken --------------------------------------------------------------------------------

@register_combiner("output-path-only", "input path dropped: dE = g.T @ h only",
                   "SUM/ROWS", "input_path_missing", "builtin")
def _output_only(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    return g.T @ h


@register_combiner("input-path-only", "output path dropped: dE = scatter-add of dx only",
                   "SUM", "output_path_missing", "builtin")
def _input_only(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    return scatter_rows(tokens, dx, V)


@register_combiner("duplicates-buffered",
                   "numpy buffered fancy-index add dE[tokens] += dx: one update per unique token",
                   "DUP", "duplicates_not_accumulated", "builtin")
def _dup_buffered(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    dE = g.T @ h
    dE[tokens] += dx  # the bug: repeated indices are applied once (last occurrence wins)
    return dE
