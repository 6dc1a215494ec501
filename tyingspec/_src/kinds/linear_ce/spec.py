"""The linear-ce kind's table entry: a fused linear-cross-entropy kernel (a function, or a
Liger-style class), judged on its dE plus the input path its dh implies.

Torch loads only for a torch-form kernel, inside the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import Returned
from tyingspec._src.core.cases import ENTRY_BYTES, OVERHEAD, Batch, Case
from tyingspec._src.core.kind import Implementation, Inputs, KindSpec, zoo
from tyingspec._src.core.paths import Paths
from tyingspec._src.kinds.linear_ce import draws, interpreter, kind
from tyingspec._src.kinds.linear_ce.options import ce_ignore_index, ce_problem


def _invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    # lazy: the kind table loads this spec without torch or triton; the adapter may load them
    from tyingspec._src.kinds.linear_ce.adapter import (
        call_linear_ce,  # torch only for a torch-form kernel
    )

    return call_linear_ce(spec, fn, inputs)


def _signature(fn: Callable[..., Any]) -> str | None:
    # lazy: as above, the adapter only when a target is checked
    from tyingspec._src.kinds.linear_ce.adapter import signature_problem

    return signature_problem(fn)


def _reference(batch: Batch, inputs: Inputs, precision: str,
               returned: Returned | None) -> Paths:
    if returned is None:
        raise ValueError("a linear-ce kernel's reference includes the input path its dh "
                         "implies: judge a call (tyingspec.observe) instead")
    # complete takes over what it is given (its dE may become the tied total): the caller's
    # Returned keeps its own
    return kind.complete(batch, inputs, precision,
                         replace(returned, dE=np.array(returned.dE, copy=True)))[1]


def _unfit(described: dict[str, Any], case: Case) -> str | None:
    missing = sorted(kind.needed_options(case) - set(described.get("options", ())))
    return f"needs option(s) {', '.join(missing)}, which the kernel does not declare" \
        if missing else None


def _builtins() -> dict[str, Implementation]:
    # lazy: the zoo's torch-form kernels are built only when built-ins are listed
    from tyingspec._src.kinds.linear_ce import zoo as ce_zoo

    return zoo("linear-ce", ce_zoo, ce_zoo.LINEAR_CE_BUILTINS)


def _builtin_needs(name: str) -> str | None:
    # a built-in of the linear-ce kind can be a torch module (its numpy twins need nothing)
    # lazy: the zoo is read only for a built-in's name, never at the table's load
    from tyingspec._src.kinds.linear_ce.zoo import LINEAR_CE_BUILTINS

    builtin = LINEAR_CE_BUILTINS.get(name)
    return "torch" if builtin is not None and builtin.form == "torch" else None


#: [V, d] arrays a linear-ce check holds at its peak (see :func:`peak_bytes`).
FIT_CE = 10


def peak_bytes(V: int, d: int, N: int, precision: str = "float64") -> int:
    """About how many bytes a linear-ce check at ``V, d, N`` in ``precision`` holds at its
    peak: ten [V, d] arrays of ``w = max(e, 4)`` bytes (``e`` a built entry's size) and two
    [N, V] (E and the copy the torch form is handed, the kernel's dE and the autograd buffers
    of its chunks, the reference's dE, the first call's tied gradient in float64 beside the
    repeat's): 3.04 GB measured (RSS from ``/usr/bin/time -v``) for ``tyingspec check ce-torch
    --kind linear-ce --case ce-plain`` at 32768,2048,1024 float32, 1.5% under this."""
    w = max(ENTRY_BYTES.get(precision, 8), 4)
    return FIT_CE * V * d * w + 2 * N * V * w + OVERHEAD


SPEC = KindSpec(
    name="linear-ce",
    contract="f(h, E, targets, b, *, grad_output, **options) -> {'loss', 'dh', 'dE', 'db'}, "
             "or a class cls(**options)(weight, input, target, bias) -> loss (Liger's)",
    positional=("h", "E", "targets", "b"), keywords=(), inputs=kind.inputs,
    invoke=_invoke, reference=_reference, second_call="repeat",
    properties=("ce_kernel_outputs", "ce_tie_is_the_sum_of_paths"),
    builtins=_builtins, complete=kind.complete, cases=kind.standard_ce_cases, unfit=_unfit,
    shape_cases=kind.shape_ce_cases, flags=(("device", kind.DEVICES),),
    signature=_signature, before_import=interpreter.before_import,
    builtin_needs=_builtin_needs, ignored_target=ce_ignore_index, options_problem=ce_problem,
    peak_bytes=peak_bytes, draws=draws.draws, e_scale_at=draws.e_scale_at,
    length_cases=draws.LENGTH_CASES)
