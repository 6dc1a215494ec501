"""The torch kind's table entry: a user's ``nn.Module`` factory (or a ``TorchTarget``), its tie
found and every use observed where it runs (:mod:`kinds.torch.adapter`, in the worker).

Nothing here imports torch: the call does, in the process that runs the model.
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
from tyingspec._src.kinds.torch.setting import (
    AUTOCAST_DTYPES,
    COMPILE_BACKENDS,
    DEVICES,
    shape_cases,
    torch_cases,
)


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    # lazy: the kind table loads this spec without torch; the adapter imports it
    from tyingspec._src.kinds.torch.adapter import (
        call_torch,  # imports torch: only where a torch target runs
    )

    return call_torch(spec, fn, inputs)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    return observed_reference("torch", inputs, returned)


def _builtins() -> dict[str, Implementation]:
    # lazy: the zoo imports torch and transformers, needed only when built-ins are listed
    from tyingspec._src.kinds.torch import zoo as torch_zoo

    return zoo("torch", torch_zoo, torch_zoo.TORCH_BUILTINS)


#: The checks a quick check runs (of those the call runs beyond the rows, ``inputs["checks"]``,
#: see ``kinds.torch.adapter.CHECKS``): a torch model's identity and optimizer checks
#: (batch-independent, run once), its gradient by path and against the forward (which judges
#: a model whose uses cannot be observed); not the fresh-gradient, micro-batch and
#: training-step checks, each one or more further passes a case.  A JAX model's checks are all
#: of the first sort, so it runs them all.
QUICK_CHECKS = ("identity", "optimizer", "gradient", "forward")

SPEC = KindSpec(
    name="torch",
    contract="make_model() -> nn.Module (a fresh one per call), or a tyingspec.TorchTarget",
    positional=(), keywords=(), inputs=seeded_inputs, invoke=_invoke,
    reference=_reference, second_call="none",
    properties=("torch_tie_identity", "torch_optimizer_sees_tie_once",
                "torch_gradient_by_path", "torch_gradient_against_forward",
                "torch_fresh_gradient", "torch_micro_batches_accumulate"),
    builtins=_builtins, own_shape=True, takes_precision=True, cases=torch_cases,
    shape_cases=shape_cases,
    flags=(("autocast", AUTOCAST_DTYPES), ("compile", COMPILE_BACKENDS), ("device", DEVICES)),
    needs="torch", no_padding_flag="declares its own padding_idx", quick_checks=QUICK_CHECKS)
