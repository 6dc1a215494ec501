"""The jax kind's table entry: a Flax NNX module factory, a Linen module with its variables, or
a pure ``loss_fn(params, tokens, targets)`` (a ``tyingspec.JaxTarget``), its tie found in the
loss's jaxpr and its two paths split there (:mod:`kinds.jax.adapter`, in the worker).

Nothing here imports jax: the call does, in the process that runs the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import Batch, kernel_paths
from tyingspec._src.core.kind import Implementation, Inputs, KindSpec, zoo
from tyingspec._src.core.paths import Paths


def _inputs(batch: Batch) -> Inputs:
    # a replay of the case hands the same seed to the forward check's directions
    seed = zlib.crc32(np.ascontiguousarray(batch.tokens, dtype=np.int64).tobytes())
    return {"tokens": batch.tokens, "targets": batch.targets, "seed": seed}


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    from tyingspec._src.kinds.jax.adapter import call_jax  # imports jax: only where it runs

    return call_jax(spec, fn, inputs)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    if returned is None:
        raise ValueError("a jax model's reference is observed in its call: pass the call's "
                         "result")
    ev = returned.evidence
    V, d = int(ev["tie"]["vocab"]), int(ev["tie"]["width"])
    loss = 0.0 if returned.loss is None else returned.loss
    if ev.get("observed_by") == "uses":
        paths = kernel_paths(ev["tokens"], ev["dx"], ev["h"], ev["g"], V, "float64")
        return replace(paths, loss=loss)
    # A use could not be observed: the paths are JAX's own split of the inlined primal, and
    # the verdict rests on the forward check (a finding), as the torch kind's does.
    own = np.asarray(returned.dE, dtype=np.float64)
    tokens = np.asarray(inputs["tokens"], dtype=np.int64).reshape(-1)
    return Paths(loss=loss, dE_in=ev["dE_in"], dE_out=own - ev["dE_in"], dW=np.zeros((0, 0)),
                 db=None, per_position=np.zeros((tokens.size, d)), tokens=tokens)


def _builtins() -> dict[str, Implementation]:
    from tyingspec._src.kinds.jax import zoo as jax_zoo

    return zoo("jax", jax_zoo, jax_zoo.JAX_BUILTINS)


SPEC = KindSpec(
    name="jax",
    contract="make_model() -> flax.nnx.Module (a fresh one per call), or a tyingspec.JaxTarget "
             "(a Linen module and its variables, or a pure loss_fn(params, tokens, targets))",
    positional=(), keywords=(), inputs=_inputs, invoke=_invoke,
    reference=_reference, second_call="none",
    properties=("jax_tie_identity", "jax_optimizer_sees_tie_once", "jax_gradient_by_path",
                "jax_gradient_against_forward"),
    builtins=_builtins, own_shape=True, takes_precision=True)
