"""The torch kind's table entry: a user's ``nn.Module`` factory (or a ``TorchTarget``), its tie
found and every use observed where it runs (:mod:`kinds.torch.adapter`, in the worker).

Nothing here imports torch: the call does, in the process that runs the model.
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
    # the model's initialisation is drawn from the tokens: a replay of the case rebuilds it
    seed = zlib.crc32(np.ascontiguousarray(batch.tokens, dtype=np.int64).tobytes())
    return {"tokens": batch.tokens, "targets": batch.targets, "seed": seed}


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    from tyingspec._src.kinds.torch.adapter import (
        call_torch,  # imports torch: only where a torch target runs
    )

    return call_torch(spec, fn, inputs)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    if returned is None:
        raise ValueError("a torch model's reference is observed in its call: pass the call's "
                         "result")
    ev = returned.evidence
    V, d = int(ev["tie"]["vocab"]), int(ev["tie"]["width"])
    loss = 0.0 if returned.loss is None else returned.loss
    if ev.get("observed_by") == "uses":
        paths = kernel_paths(ev["tokens"], ev["dx"], ev["h"], ev["g"], V, "float64")
        return replace(paths, loss=loss, padding_idx=ev["tie"]["padding_idx"],
                       pad_input=ev.get("pad_input"))
    # The uses could not be observed (see kinds.torch.adapter): the rows are the model's
    # own, split as its backward split them, and the verdict is the forward's (a finding).
    # The batch's tokens are still the rows its lookups read: power is judged on them, so a
    # correct model whose uses cannot be observed can pass on the forward check's word.
    own = np.asarray(returned.dE, dtype=np.float64)
    tokens = np.asarray(inputs["tokens"], dtype=np.int64).reshape(-1)
    return Paths(loss=loss, dE_in=ev["dE_in"], dE_out=own - ev["dE_in"], dW=np.zeros((0, 0)),
                 db=None, per_position=np.zeros((tokens.size, d)), tokens=tokens)


def _builtins() -> dict[str, Implementation]:
    from tyingspec._src.kinds.torch import zoo as torch_zoo

    return zoo("torch", torch_zoo, torch_zoo.TORCH_BUILTINS)


SPEC = KindSpec(
    name="torch",
    contract="make_model() -> nn.Module (a fresh one per call), or a tyingspec.TorchTarget",
    positional=(), keywords=(), inputs=_inputs, invoke=_invoke,
    reference=_reference, second_call="none",
    properties=("torch_tie_identity", "torch_optimizer_sees_tie_once",
                "torch_gradient_by_path", "torch_gradient_against_forward",
                "torch_fresh_gradient", "torch_micro_batches_accumulate"),
    builtins=_builtins, own_shape=True, takes_precision=True)
