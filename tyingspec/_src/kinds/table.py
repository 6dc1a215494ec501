"""The adapter kinds: one entry per kind, and nothing else knows how a kind is called.

An entry says what a kind's adapter looks like (its contract and parameter names, used to spot
a target of the wrong kind before the first call), which arrays it is handed for a batch, how it
is called and its outputs validated, which reference it is judged against, whether it is called
a second time after an SGD step, and which properties apply to it.  The engine
(:mod:`engine.observe`), ``tyingspec check``, the properties, the pytest plugin and the kill
matrix all go through this table: a new kind is a new entry here, its adapter module and its
tests.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import numpy as np

from tyingspec._src.core.adapters import (
    AdapterError,
    Returned,
    call_kernel,
    call_model,
    signature_problem,
)
from tyingspec._src.core.cases import Batch, Case, kernel_paths, model_reference, standard_cases
from tyingspec._src.core.paths import Paths, forward_parts
from tyingspec._src.kinds.probe.registry import Implementation

Kind = Literal["model", "kernel", "torch", "linear-ce"]
#: ``sgd_step``: again after E moved by one SGD step along the dE it returned (a model: a copied
#: tie shows here); ``repeat``: again on the same inputs (a kernel: a stale workspace shows);
#: ``none``: the kind's call runs its own repeated passes (torch: fresh and micro-batch checks).
SecondCall = Literal["sgd_step", "repeat", "none"]
KIND_NAMES: tuple[Kind, ...] = get_args(Kind)

Inputs = dict[str, Any]


@dataclass(frozen=True)
class KindSpec:
    """One adapter kind."""

    name: Kind
    contract: str  # the signature a person reads
    positional: tuple[str, ...]  # parameters a matching adapter accepts positionally
    keywords: tuple[str, ...]  # keyword-only parameters it must accept
    inputs: Callable[[Batch], Inputs]  # the arrays handed to the adapter for a batch
    invoke: Callable[[str, Callable[..., Any], Inputs], Returned]  # call and validate
    # the two-path reference for those inputs, for a check judged at the given precision
    # (the call's result is passed too: a torch model's paths are observed where it runs)
    reference: Callable[[Batch, Inputs, str, Returned | None], Paths]
    second_call: SecondCall  # how it is called a second time (see the engine)
    properties: tuple[str, ...]  # the properties that apply, in the order they are listed
    # the kind's built-in targets by name (None: the shared registry of model/kernel forms)
    builtins: Callable[[], dict[str, Implementation]] | None = None
    # True when the batch shape (V, d, N) is the target's own (a model's vocabulary, width
    # and context), asked of it before the first case (see ``engine.observe.shape_of``)
    own_shape: bool = False
    # the kind's own judgement of a call, instead of ``reference`` alone: the reference paths
    # and the returned value completed (a linear-ce kernel's dE plus the input path its dh
    # implies, and its outputs' findings)
    complete: Callable[[Batch, Inputs, str, Returned], tuple[Returned, Paths]] | None = None
    # the seeded cases ``tyingspec check`` runs (default: the probe model's standard cases)
    cases: Callable[[int], list[Case]] = standard_cases
    # why a case cannot run on a target, from what the target says of itself (its options);
    # None: it can (see ``engine.observe.runnable``)
    unfit: Callable[[dict[str, Any], Case], str | None] | None = None
    # True when the target runs in its own dtype unless one is declared: the engine hands it
    # ``precision`` ("auto" or the declared one) with its inputs (a torch model)
    takes_precision: bool = False
    # why a callable is not an adapter of this kind, when the positional/keyword names cannot
    # say (a linear-ce kernel class: options in its constructor, the arrays in ``forward``)
    signature: Callable[[Callable[..., Any]], str | None] | None = None

    def mismatch(self, fn: Callable[..., Any]) -> str | None:
        """Why ``fn`` does not look like an adapter of this kind; None when it does."""
        if self.signature is not None:
            return self.signature(fn)
        return signature_problem(fn, self.positional, self.keywords)


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
    # the kernel's inputs come from a real forward pass of the probe model on the batch
    p = forward_parts(batch.E, batch.E, batch.W, batch.b, batch.tokens, batch.targets,
                      batch.res, batch.s_in)
    return {"tokens": batch.tokens, "dx": p.input_rows, "h": p.h, "g": p.g,
            "vocab_size": batch.E.shape[0]}


def _kernel_reference(batch: Batch, inputs: Inputs, precision: str,
                      returned: Returned | None) -> Paths:
    return kernel_paths(inputs["tokens"], inputs["dx"], inputs["h"], inputs["g"],
                        inputs["vocab_size"], precision)


def _torch_inputs(batch: Batch) -> Inputs:
    # the model's initialisation is drawn from the tokens: a replay of the case rebuilds it
    seed = zlib.crc32(np.ascontiguousarray(batch.tokens, dtype=np.int64).tobytes())
    return {"tokens": batch.tokens, "targets": batch.targets, "seed": seed}


def _torch_invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    from tyingspec._src.kinds.torch.adapter import (
        call_torch,  # imports torch: only where a torch target runs
    )

    return call_torch(spec, fn, inputs)


def _torch_reference(batch: Batch, inputs: Inputs, precision: str,
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


def _ce_invoke(spec: str, fn: Callable[..., Any], inputs: Inputs) -> Returned:
    from tyingspec._src.kinds.linear_ce.adapter import (
        call_linear_ce,  # torch only for a torch-form kernel
    )

    return call_linear_ce(spec, fn, inputs)


def _ce_signature(fn: Callable[..., Any]) -> str | None:
    from tyingspec._src.kinds.linear_ce.adapter import signature_problem as ce_problem

    return ce_problem(fn)


def _ce_inputs(batch: Batch) -> Inputs:
    from tyingspec._src.kinds.linear_ce.kind import inputs

    return inputs(batch)


def _ce_reference(batch: Batch, inputs: Inputs, precision: str,
                  returned: Returned | None) -> Paths:
    if returned is None:
        raise ValueError("a linear-ce kernel's reference includes the input path its dh "
                         "implies: judge a call (tyingspec.observe) instead")
    return _ce_complete(batch, inputs, precision, returned)[1]


def _ce_complete(batch: Batch, inputs: Inputs, precision: str,
                 returned: Returned) -> tuple[Returned, Paths]:
    from tyingspec._src.kinds.linear_ce.kind import complete

    return complete(batch, inputs, precision, returned)


def _ce_cases(seed: int) -> list[Case]:
    from tyingspec._src.kinds.linear_ce.kind import standard_ce_cases

    return standard_ce_cases(seed)


def _ce_unfit(described: dict[str, Any], case: Case) -> str | None:
    from tyingspec._src.kinds.linear_ce.kind import needed_options

    missing = sorted(needed_options(case) - set(described.get("options", ())))
    return f"needs option(s) {', '.join(missing)}, which the kernel does not declare" \
        if missing else None


def _zoo(kind: str, module: Any, table: dict[str, Any]) -> dict[str, Implementation]:
    return {name: Implementation(name, b.description, b.breaks, b.expected,
                                 forms={kind: getattr(module, b.attr)})
            for name, b in table.items()}


def _ce_builtins() -> dict[str, Implementation]:
    from tyingspec._src.kinds.linear_ce import zoo

    return _zoo("linear-ce", zoo, zoo.LINEAR_CE_BUILTINS)


def _torch_builtins() -> dict[str, Implementation]:
    from tyingspec._src.kinds.torch import zoo

    return _zoo("torch", zoo, zoo.TORCH_BUILTINS)


KINDS: dict[Kind, KindSpec] = {
    "model": KindSpec(
        name="model",
        contract="f(E, W, b, tokens, targets, *, res, s_in[, padding_idx]) -> "
                 "{'loss', 'dE', 'dW', 'db'}",
        positional=("E", "W", "b", "tokens", "targets"), keywords=("res", "s_in"),
        inputs=_model_inputs, invoke=call_model, reference=_model_reference, second_call="sgd_step",
        properties=("sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
                    "relabelling_permutes_rows", "micro_batches_accumulate",
                    "loss_dW_db_right", "inputs_untouched", "same_call_same_gradient",
                    "tie_survives_a_step")),
    "kernel": KindSpec(
        name="kernel", contract="f(tokens, dx, h, g, vocab_size) -> dE",
        positional=("tokens", "dx", "h", "g", "vocab_size"), keywords=(),
        inputs=_kernel_inputs, invoke=call_kernel, reference=_kernel_reference,
        second_call="repeat",
        properties=("sum_of_paths", "absent_rows_are_output_path", "repeated_tokens_accumulate",
                    "relabelling_permutes_rows", "micro_batches_accumulate",
                    "inputs_untouched", "same_call_same_gradient", "linear_in_dx",
                    "linear_in_g")),
    "torch": KindSpec(
        name="torch",
        contract="make_model() -> nn.Module (a fresh one per call), or a tyingspec.TorchTarget",
        positional=(), keywords=(), inputs=_torch_inputs, invoke=_torch_invoke,
        reference=_torch_reference, second_call="none",
        properties=("torch_tie_identity", "torch_optimizer_sees_tie_once",
                    "torch_gradient_by_path", "torch_gradient_against_forward",
                    "torch_fresh_gradient", "torch_micro_batches_accumulate"),
        builtins=_torch_builtins, own_shape=True, takes_precision=True),
    "linear-ce": KindSpec(
        name="linear-ce",
        contract="f(h, E, targets, b, *, grad_output, **options) -> {'loss', 'dh', 'dE', 'db'}, "
                 "or a class cls(**options)(weight, input, target, bias) -> loss (Liger's)",
        positional=("h", "E", "targets", "b"), keywords=(), inputs=_ce_inputs,
        invoke=_ce_invoke, reference=_ce_reference, second_call="repeat",
        properties=("ce_kernel_outputs", "ce_tie_is_the_sum_of_paths"),
        builtins=_ce_builtins, complete=_ce_complete, cases=_ce_cases, unfit=_ce_unfit,
        signature=_ce_signature),
}


def fitting(fn: Callable[..., Any], kind: str) -> tuple[str | None, list[str]]:
    """Why ``fn`` is not a ``kind`` adapter (None when it is), and the other kinds it fits."""
    return KINDS[kind].mismatch(fn), [  # type: ignore[index]
        k for k, t in KINDS.items() if k != kind and t.mismatch(fn) is None]


def kind_spec(name: str) -> KindSpec:
    """The table entry of ``name``; ValueError naming the known kinds otherwise."""
    try:
        return KINDS[name]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown kind {name!r}; expected one of {', '.join(KINDS)}") from None


def resolve(spec: str, kind: str) -> Callable[..., Any]:
    """Turn a target spec (built-in name or ``module:attr``) into a callable of ``kind``."""
    if kind not in KINDS:
        raise AdapterError(spec, f"unknown kind {kind!r}", expected=" or ".join(KINDS), got=kind)
    if ":" not in spec:
        own = KINDS[kind].builtins
        if own is not None:  # a kind with its own built-ins (torch: the model zoo)
            known = own()
        else:
            from tyingspec._src.kinds.probe.builtins import (
                builtins,  # only a built-in name loads the zoo
            )

            known = builtins()
        impl = known.get(spec)
        fn = None if impl is None else impl.adapter(kind)
        if spec not in known:
            raise AdapterError(spec, "cannot be resolved",
                               expected="a built-in name (" + ", ".join(sorted(known))
                               + ") or module:attr", got=repr(spec))
        if fn is None:
            raise AdapterError(spec, f"built-in has no {kind} form")
        return fn
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail in any way: report it as the adapter's
        raise AdapterError(spec, f"module {module_name!r} cannot be imported",
                           got=f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AdapterError(spec, f"module {module_name!r} has no attribute {attr!r}"
                               ) from None
        except Exception as exc:  # a module __getattr__ can raise anything
            raise AdapterError(spec, f"looking up {attr!r} in {module_name!r} raised",
                               got=f"{type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise AdapterError(spec, "is not callable", got=type(obj).__name__)
    return obj  # type: ignore[no-any-return]
