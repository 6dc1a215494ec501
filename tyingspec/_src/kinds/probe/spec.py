"""The two probe kinds' table entries: ``model`` (a whole forward+backward of the probe model)
and ``kernel`` (the backward's combination of the two paths alone).

Both share one zoo (:mod:`kinds.probe.builtins`): every built-in there has a model form, and a
kernel form where it is a path combiner.
"""

from __future__ import annotations

from dataclasses import replace

from tyingspec._src.core.adapters import Returned, call_kernel, call_model
from tyingspec._src.core.cases import Batch, kernel_paths, model_reference, released
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


def _builtins() -> dict[str, Implementation]:
    from tyingspec._src.kinds.probe.builtins import (
        builtins,  # only a built-in name loads the zoo
    )

    return builtins()


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
    builtins=_builtins)

KERNEL = KindSpec(
    name="kernel", contract="f(tokens, dx, h, g, vocab_size) -> dE",
    positional=("tokens", "dx", "h", "g", "vocab_size"), keywords=(),
    inputs=_kernel_inputs, invoke=call_kernel, reference=_kernel_reference,
    second_call="repeat", release=released,
    properties=("sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
                "relabelling_permutes_rows", "micro_batches_accumulate",
                "inputs_untouched", "same_call_same_gradient", "linear_in_dx",
                "linear_in_g"),
    builtins=_builtins)
