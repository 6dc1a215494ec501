"""The jax kind's table entry: a Flax NNX module factory, a Linen module with its variables, or
a pure ``loss_fn(params, tokens, targets)`` (a ``tyingspec.JaxTarget``), its tie found in the
loss's jaxpr and its two paths split there (:mod:`kinds.jax.adapter`, in the worker); each
case's batch and table dtype drawn at the model's own shape (:mod:`kinds.jax.setting`).

Nothing here imports jax: the call does, in the process that runs the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import Batch
from tyingspec._src.core.kind import (
    Implementation,
    Inputs,
    KindSpec,
    observed_reference,
    seeded_inputs,
    zoo,
)
from tyingspec._src.core.paths import Paths
from tyingspec._src.kinds.jax.setting import jax_cases, shape_cases


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    # lazy: the kind table loads this spec without jax; the adapter imports it
    from tyingspec._src.kinds.jax.adapter import call_jax  # imports jax: only where it runs

    return call_jax(spec, fn, inputs)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    return observed_reference("jax", inputs, returned)


def _builtins() -> dict[str, Implementation]:
    # lazy: the zoo imports jax, needed only when built-ins are listed
    from tyingspec._src.kinds.jax import zoo as jax_zoo

    return zoo("jax", jax_zoo, jax_zoo.JAX_BUILTINS)


SPEC = KindSpec(
    name="jax",
    contract="make_model() -> flax.nnx.Module (a fresh one per call), or a tyingspec.JaxTarget "
             "(a Linen module and its variables, or a pure loss_fn(params, tokens, targets))",
    positional=(), keywords=(), inputs=seeded_inputs, invoke=_invoke,
    reference=_reference, second_call="none",
    properties=("jax_tie_identity", "jax_optimizer_sees_tie_once", "jax_gradient_by_path",
                "jax_gradient_against_forward"),
    builtins=_builtins, own_shape=True, takes_precision=True, cases=jax_cases,
    shape_cases=shape_cases, needs="jax")
