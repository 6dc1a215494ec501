"""The registry of built-in targets: a name, what it breaks, the label a check must reach.

Only the registry lives here.  The correct built-ins register in ``_implementations`` and the
mutant zoo in ``_mutants``; :func:`builtins` loads both.  Resolving a user's ``module:attr``
adapter never imports either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tyingspec._src.core.kind import Implementation as Implementation
from tyingspec._src.core.paths import Array, IntArray, flatten_batch, forward_parts

Combiner = Callable[[IntArray, Array, Array, Array, int], Array]
ModelFn = Callable[..., Mapping[str, Any]]


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
