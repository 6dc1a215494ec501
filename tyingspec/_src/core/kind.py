"""What an adapter kind is: the record each kind's folder fills in, and a named built-in target.

A kind's folder (``kinds/<kind>/``) defines its :class:`KindSpec` in ``spec.py``; the table
(:mod:`kinds.table`) names that module, one line per kind, and loads it the first time the kind
is asked for.  The engine, ``tyingspec check``, the properties, the pytest plugin and the kill
matrix only ever read these records, so a kind is its folder and its table line.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tyingspec._src.core.adapters import signature_problem
from tyingspec._src.core.cases import Case, kernel_paths, model_bytes, standard_cases
from tyingspec._src.core.paths import Paths

if TYPE_CHECKING:
    from tyingspec._src.core.adapters import Returned
    from tyingspec._src.core.cases import Batch

#: a kind's name, as ``--kind`` spells it (the table's keys are the known ones)
Kind = str
#: ``sgd_step``: again after E moved by one SGD step along the dE it returned (a model: a copied
#: tie shows here); ``repeat``: again on the same inputs (a kernel: a stale workspace shows);
#: ``none``: the kind's call runs its own repeated passes (torch: fresh and micro-batch checks).
SecondCall = Literal["sgd_step", "repeat", "none"]

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Implementation:
    """A named built-in target: a model adapter, optionally also a kernel adapter."""

    name: str
    description: str
    breaks: str | None  # invariant it breaks; None for a correct implementation
    expected: str  # diagnosis label the checker should reach
    model: Callable[..., Mapping[str, Any]] | None = None
    kernel: Callable[..., Any] | None = None
    tags: tuple[str, ...] = field(default=())
    # a kind's own built-in (torch, linear-ce): its adapter, by kind
    forms: Mapping[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.breaks is None

    def adapter(self, kind: str) -> Callable[..., Any] | None:
        if kind in self.forms:
            return self.forms[kind]  # type: ignore[no-any-return]
        return {"model": self.model, "kernel": self.kernel}.get(kind)


def zoo(kind: str, module: Any, table: Mapping[str, Any]) -> dict[str, Implementation]:
    """A kind's built-in table (name -> an entry with description, breaks, expected, attr) as
    :class:`Implementation` records whose ``kind`` form is ``module.<attr>``."""
    return {name: Implementation(name, b.description, b.breaks, b.expected,
                                 forms={kind: getattr(module, b.attr)})
            for name, b in table.items()}


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
    # the kind's built-in targets by name
    builtins: Callable[[], dict[str, Implementation]]
    # True when the batch shape (V, d, N) is the target's own (a model's vocabulary, width
    # and context), asked of it before the first case (see ``engine.observe.shape_of``)
    own_shape: bool = False
    # the batch once its inputs exist, without what they no longer need (a kernel's E, see
    # ``core.cases.released``); None: the batch is kept whole
    release: Callable[[Batch, Inputs], Batch] | None = None
    # the kind's own judgement of a call, instead of ``reference`` alone: the reference paths
    # and the returned value completed (a linear-ce kernel's dE plus the input path its dh
    # implies, and its outputs' findings)
    complete: Callable[[Batch, Inputs, str, Returned], tuple[Returned, Paths]] | None = None
    # the seeded cases ``tyingspec check`` runs (default: the probe model's standard cases)
    cases: Callable[[int], list[Case]] = standard_cases
    # why a case cannot run on a target, from what the target says of itself (its options);
    # None: it can (see ``engine.observe.runnable``)
    unfit: Callable[[dict[str, Any], Case], str | None] | None = None
    # the cases at the target's own shape, from what it says of itself (``engine.observe.
    # described``), and the report's notes on them; None: every case at the one shape
    # ``own_shape`` asks of the target (see ``engine.observe.shaped``)
    shape_cases: Callable[[str, dict[str, Any], list[Case]],
                          tuple[list[Case], list[str]]] | None = None
    # settings the command line (``--autocast bfloat16``, ``--compile``) and the API set for
    # every case, as ``key=value`` in its setting (see ``Case.with_setting``), with the values
    # each takes (an empty string: the flag alone, given its first value)
    flags: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # True when the target runs in its own dtype unless one is declared: the engine hands it
    # ``precision`` ("auto" or the declared one) with its inputs (a torch model)
    takes_precision: bool = False
    # why a callable is not an adapter of this kind, when the positional/keyword names cannot
    # say (a linear-ce kernel class: options in its constructor, the arrays in ``forward``)
    signature: Callable[[Callable[..., Any]], str | None] | None = None
    # what the worker process does before it imports a target of this kind (linear-ce: the
    # Triton interpreter switched on where no GPU is, which must precede triton's import)
    before_import: Callable[[], None] | None = None
    # the module every run of the kind imports whatever the target (``--kind torch``: torch),
    # required before the run so that its absence is a usage error naming the extra
    needs: str | None = None
    # the module a built-in target needs beyond ``needs``, by its name (a linear-ce built-in
    # that is a torch module); None: none does
    builtin_needs: Callable[[str], str | None] | None = None
    # why ``--padding-idx`` does not apply to a target of this kind (it declares its own, or
    # gets the rows it scatters as they are); None: it does (the model kind)
    no_padding_flag: str | None = "gets the rows it scatters as they are"
    # the target id an ignored token carries in a case's batch, from the case's options
    # (linear-ce: its ``ignore_index``, else -100); None: a batch holds no ignored target
    ignored_target: Callable[[str], int] | None = None
    # why a case's kind options (``Case.ce``) cannot be run; None: the kind takes none
    options_problem: Callable[[str], str | None] | None = None
    # True when the reference is a function of the inputs and the precision alone, so that the
    # engine may build it before the call returns (``engine.observe``); a torch model's is
    # observed in its call
    reference_first: bool = False
    # about how many bytes a check at ``V, d, N`` in a precision holds at its peak (see
    # ``core.cases.model_bytes``)
    peak_bytes: Callable[[int, int, int, str], int] = model_bytes
    # the kind's own draws on the batch ``core.cases.build`` made from a case's seed, from
    # its options (``Case.ce``: linear-ce's ignored targets, class weights, upstream
    # gradient); None: the kind's cases carry no options
    draws: Callable[[Batch, Case], Batch] | None = None
    # E's scale for a case at another width (``--shape``, see ``core.cases.at_shape``), to
    # keep the logits the case is drawn for; None (or a None result): ``SHAPE_E_SCALE``
    e_scale_at: Callable[[Case, int], float | None] | None = None
    # cases whose point is their length: ``--shape`` gives them its V and d, keeps their N
    length_cases: tuple[str, ...] = ()
    # the kind's own checks a quick check runs (``inputs["checks"]``); None: all of them
    quick_checks: tuple[str, ...] | None = None
    # the input names a micro-batch slices along the positions (``micro_batches_accumulate``)
    sliced: tuple[str, ...] = ("tokens", "targets")
    # True for a kernel's call: dE alone, a plain sum over the positions of its inputs (rows
    # and logit columns), not a model's mean loss with dW and db (the probe properties slice
    # and relabel those inputs accordingly)
    plain_sum: bool = False
    # puts the kind's stateful built-ins back as new (a mutant that drifts across calls), so
    # that a kill matrix does not depend on the order of its rows; None: none has state
    reset: Callable[[], None] | None = None

    def ignore_index(self, options: str = "") -> int | None:
        """The target id an ignored token carries in a batch of ``options`` (None: none)."""
        return None if self.ignored_target is None else self.ignored_target(options)

    def mismatch(self, fn: Callable[..., Any]) -> str | None:
        """Why ``fn`` does not look like an adapter of this kind; None when it does."""
        if self.signature is not None:
            return self.signature(fn)
        return signature_problem(fn, self.positional, self.keywords)


def seeded_inputs(batch: Batch) -> Inputs:
    """The inputs of a kind whose target builds its own model (torch, jax, distributed): the
    tokens, the targets, and a seed drawn from the tokens, so a replay of the case rebuilds the
    same initialisation (and the forward check's directions)."""
    seed = zlib.crc32(np.ascontiguousarray(batch.tokens, dtype=np.int64).tobytes())
    inputs: Inputs = {"tokens": batch.tokens, "targets": batch.targets, "seed": seed}
    if batch.setting:
        inputs["setting"] = batch.setting
    return inputs


def observed_reference(kind: str, inputs: Inputs, returned: Returned | None) -> Paths:
    """The reference of a model whose uses of the tie were observed in its call (its
    ``evidence``: the tie's shape, and ``dx``, ``h``, ``g`` at the uses, or the split its
    backward made when a use could not be observed)."""
    if returned is None:
        raise ValueError(f"a {kind} model's reference is observed in its call: pass the "
                         "call's result")
    ev = returned.evidence
    V, d = int(ev["tie"]["vocab"]), int(ev["tie"]["width"])
    loss = 0.0 if returned.loss is None else returned.loss
    if ev.get("observed_by") == "uses":
        paths = kernel_paths(ev["tokens"], ev["dx"], ev["h"], ev["g"], V, "float64")
        return replace(paths, loss=loss, padding_idx=ev["tie"].get("padding_idx"),
                       pad_input=ev.get("pad_input"))
    # A use could not be observed: the rows are the model's own, split as its backward split
    # them, and the verdict is the forward's (a finding).  The batch's tokens are still the
    # rows its lookups read: power is judged on them, so a correct model whose uses cannot be
    # observed can pass on the forward check's word.
    own = np.asarray(returned.dE, dtype=np.float64)
    tokens = np.asarray(inputs["tokens"], dtype=np.int64).reshape(-1)
    return Paths(loss=loss, dE_in=ev["dE_in"], dE_out=own - ev["dE_in"], dW=np.zeros((0, 0)),
                 db=None, per_position=np.zeros((tokens.size, d)), tokens=tokens)
