"""Built-in implementations: the correct tied model and deliberately broken variants.

Each entry says which invariant it breaks (names from the bug catalogue: SUM, ROWS, DUP, SCALE,
ID, ...) and the diagnosis a checker should reach.  Most variants differ only in how they combine
the two paths, so one *combiner* ``(tokens, dx_rows, h, g, V) -> dE`` serves both as a kernel
adapter and, wrapped around the probe model's forward/backward, as a model adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._probe import Array, IntArray, flatten_batch, forward_parts, scatter_rows

Combiner = Callable[[IntArray, Array, Array, Array, int], Array]
ModelFn = Callable[..., Mapping[str, Any]]


@dataclass(frozen=True)
class Implementation:
    """A named built-in target: a model adapter, optionally also a kernel adapter."""

    name: str
    description: str
    breaks: str | None  # invariant it breaks; None for a correct implementation
    expected: str  # diagnosis label the checker should reach
    model: ModelFn | None = None
    kernel: Combiner | None = None
    tags: tuple[str, ...] = field(default=())

    @property
    def correct(self) -> bool:
        return self.breaks is None

    def adapter(self, kind: str) -> Callable[..., Any] | None:
        return self.model if kind == "model" else self.kernel


REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation) -> Implementation:
    if impl.name in REGISTRY:
        raise ValueError(f"implementation {impl.name!r} registered twice")
    REGISTRY[impl.name] = impl
    return impl


def model_from_combiner(combine: Combiner) -> ModelFn:
    """Wrap a path combiner into a full model adapter around the probe model."""

    def model(
        E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
        *, res: float = 1.0, s_in: float = 1.0,
    ) -> dict[str, Any]:
        t, y = flatten_batch(tokens, targets)
        p = forward_parts(E, E, W, b, t, y, res, s_in)
        dE = combine(t, p.input_rows, p.h, p.g, E.shape[0])
        return {"loss": p.loss, "dE": dE, "dW": p.dW, "db": p.db}

    return model


def register_combiner(
    name: str, description: str, breaks: str | None, expected: str, *tags: str
) -> Callable[[Combiner], Combiner]:
    def deco(combine: Combiner) -> Combiner:
        register(Implementation(name, description, breaks, expected,
                                model=model_from_combiner(combine), kernel=combine, tags=tags))
        return combine

    return deco


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


def builtin(name: str) -> Implementation:
    """Look up a built-in by name with an error that lists what exists."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise KeyError(f"no built-in implementation {name!r}; known: {known}") from None




# The mutant zoo and the correct styles register themselves here, so REGISTRY always has them.
from . import _mutants  # noqa: E402,F401
