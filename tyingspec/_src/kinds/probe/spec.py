"""The two probe kinds' table entries: ``model`` (a whole forward+backward of the probe model)
and ``kernel`` (the backward's combination of the two paths alone).

Both share one zoo (:mod:`kinds.probe.builtins`): every built-in there has a model form, and a
kernel form where it is a path combiner.
"""

from __future__ import annotations

from dataclasses import replace

from tyingspec._src.core.adapters import Returned, call_kernel, call_model
from tyingspec._src.core.cases import (
    ENTRY_BYTES,
    OVERHEAD,
    Batch,
    kernel_paths,
    model_reference,
    released,
)
from tyingspec._src.core.kind import Implementation, Inputs, KindSpec
from tyingspec._src.core.paths import Paths, forward_parts


def _model_inputs(batch: Batch) -> Inputs:
    inputs: Inputs = {"E": batch.E, "W": batch.W, "b": batch.b, "tokens": batch.tokens,
                      "targets": batch.targets, "res": batch.res, "s_in": batch.s_in}
    if batch.padding_idx is not None:  # only a case that declares one passes it
        inputs["padding_idx"] = batch.padding_idx
    return inputs


def _model_reference(batch: Batch, inputs: Inputs, precision: str,
                     returned: Returned | None) -> Paths:
    return model_reference(replace(batch, E=inputs["E"], b=inputs["b"],
                                   tokens=inputs["tokens"], targets=inputs["targets"],
                                   padding_idx=inputs.get("padding_idx")), precision)


def _kernel_inputs(batch: Batch) -> Inputs:
    if batch.inputs is not None:  # made before E was let go (see core.cases.released)
        if batch.inputs["tokens"] is not batch.tokens:
            raise ValueError("this kernel batch let its E go: its tokens cannot change (build "
                             "the batch again)")
        return dict(batch.inputs)
    # the kernel's inputs come from a real forward pass of the probe model on the batch
    p = forward_parts(batch.E, batch.E, batch.W, batch.b, batch.tokens, batch.targets,
                      batch.res, batch.s_in, out_factors=batch.e_factors())
    return {"tokens": batch.tokens, "dx": p.input_rows, "h": p.h, "g": p.g,
            "vocab_size": batch.E.shape[0]}


def _kernel_reference(batch: Batch, inputs: Inputs, precision: str,
                      returned: Returned | None) -> Paths:
    return kernel_paths(inputs["tokens"], inputs["dx"], inputs["h"], inputs["g"],
                        inputs["vocab_size"], precision)


def kernel_bytes(V: int, d: int, N: int, precision: str = "float64") -> int:
    """About how many bytes a kernel check at ``V, d, N`` in ``precision`` holds at its peak:
    the larger of its two phases.  ``e`` is a built entry's size (8, 4 or 2 bytes), ``w =
    max(e, 4)`` that of what is computed from it (a bfloat16 E's forward, g and dE are
    float32).  The forward, building the inputs: E, g [N, V], and the dE kept from the previous
    case (a buffer never zeroed shows across cases).  The calls, E let go (``released``): g,
    the copy of it handed to the kernel, the previous call's dE and this call's, the kernel's
    own zeroed [V, d] (the built-in scatters into one) and the previous case's g, kept with its
    paths: ``3 Vdw + 3 NVw``.  RSS from ``/usr/bin/time -v``, numpy 2, CPU, for ``tyingspec
    check tied --kind kernel --shape V,d,N``: 1.35 GiB at 32768,2048,1024 in float32 (all seven
    cases; this says 1.25 GiB, 7% under); 5.25 GiB in float32 and 5.23 GiB in bfloat16 at
    128256,4096,1024 (one case; this says 7.5 GiB: the zeroed [V, d] was not resident there),
    so at production shapes it errs high."""
    e = ENTRY_BYTES.get(precision, 8)
    w = max(e, 4)
    forward = V * d * e + N * V * w + V * d * w
    calls = 3 * V * d * w + 3 * N * V * w
    return max(forward, calls) + OVERHEAD


def _builtins() -> dict[str, Implementation]:
    # lazy: loading the built-ins loads the mutant zoo, which a plain check never needs
    from tyingspec._src.kinds.probe.builtins import (
        builtins,  # only a built-in name loads the zoo
    )

    return builtins()


def _reset() -> None:
    # lazy: only a kill matrix loads the mutants
    from tyingspec._src.kinds.probe.mutants import reset_state

    reset_state()


MODEL = KindSpec(
    name="model",
    contract="f(E, W, b, tokens, targets, *, res, s_in[, padding_idx]) -> "
             "{'loss', 'dE', 'dW', 'db'}",
    positional=("E", "W", "b", "tokens", "targets"), keywords=("res", "s_in"),
    inputs=_model_inputs, invoke=call_model, reference=_model_reference, second_call="sgd_step",
    properties=("sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
                "relabelling_permutes_rows", "micro_batches_accumulate",
                "loss_dW_db_right", "inputs_untouched", "same_call_same_gradient",
                "tie_survives_a_step"),
    builtins=_builtins, no_padding_flag=None, reference_first=True, reset=_reset)

KERNEL = KindSpec(
    name="kernel", contract="f(tokens, dx, h, g, vocab_size) -> dE",
    positional=("tokens", "dx", "h", "g", "vocab_size"), keywords=(),
    inputs=_kernel_inputs, invoke=call_kernel, reference=_kernel_reference,
    second_call="repeat", release=released,
    properties=("sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
                "relabelling_permutes_rows", "micro_batches_accumulate",
                "inputs_untouched", "same_call_same_gradient", "linear_in_dx",
                "linear_in_g"),
    builtins=_builtins, reference_first=True, peak_bytes=kernel_bytes,
    sliced=("tokens", "dx", "h", "g"), plain_sum=True, reset=_reset)
