"""The distributed kind's table entry: a user's ``torch.distributed`` training step (a
``tyingspec.DistributedTarget``), run on every rank of a gloo world tyingspec launches, each
rank's copy of the tied matrix judged against the single-process tied gradient
(:mod:`kinds.distributed.adapter`, where the target runs).

Nothing here imports torch: the call does, in the process that runs the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import Batch
from tyingspec._src.core.kind import Implementation, Inputs, KindSpec, seeded_inputs, zoo
from tyingspec._src.core.paths import Paths
from tyingspec._src.core.tolerance import Terms


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    # lazy: the kind table loads this spec without torch; the adapter imports it
    from tyingspec._src.kinds.distributed.adapter import (
        call_distributed,  # imports torch: only where the ranks run
    )

    return call_distributed(spec, fn, inputs)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    if returned is None:
        raise ValueError("a distributed target's reference is built in its call: pass the "
                         "call's result")
    ev = returned.evidence
    return Paths(loss=float(ev["loss"]), dE_in=ev["dE_in"], dE_out=ev["dE_out"],
                 dW=np.zeros((0, 0)), db=None, per_position=ev["per_position"],
                 tokens=np.asarray(ev["tokens"], dtype=np.int64),
                 terms=Terms(rows=np.asarray(ev["bound_rows"]), k=float(ev["bound_k"])),
                 padding_idx=ev["padding_idx"])


def _signature(fn: Callable[..., Any]) -> str | None:
    missing = [a for a in ("reference", "embedding", "setup", "step") if not hasattr(fn, a)]
    if missing:
        return (f"{type(fn).__name__} has no {', '.join(missing)} (a distributed target is a "
                "tyingspec.DistributedTarget)")
    return None


def _builtins() -> dict[str, Implementation]:
    # lazy: the zoo imports torch, needed only when built-ins are listed
    from tyingspec._src.kinds.distributed import zoo as dist_zoo

    return zoo("distributed", dist_zoo, dist_zoo.DISTRIBUTED_BUILTINS)


SPEC = KindSpec(
    name="distributed",
    contract="a tyingspec.DistributedTarget(reference, embedding, setup, step, layouts): "
             "setup(world) -> (state, copy of E or None) and step(world, state, tokens, "
             "targets) run on every rank; reference() -> the single-process nn.Module",
    positional=(), keywords=(), inputs=seeded_inputs, invoke=_invoke,
    reference=_reference, second_call="none",
    properties=("distributed_copies_equal_at_start", "distributed_gradient_after_sync",
                "distributed_copies_equal_after_step"),
    builtins=_builtins, own_shape=True, signature=_signature, needs="torch")
