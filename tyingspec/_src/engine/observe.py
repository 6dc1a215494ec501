"""The engine: observe a target on one case and judge it.  Every front end goes through here.

``tyingspec check``, every property, the pytest plugin and the kill matrix call :func:`observe`
(or, for a metamorphic property that needs a call on changed inputs, :func:`call`,
:func:`reference` and :func:`judge`); none of them builds an adapter's inputs, calls it, picks a
reference or a precision, or sets a tolerance itself.  What differs between adapter kinds lives
in the table of :mod:`kinds.table`.

One observation:

1. build the case's arrays (in the declared precision, when one is declared);
2. hand the kind's inputs to the adapter (copies) and validate what it returned;
3. build the float64 reference for those inputs (sympy on small shapes, closed form beyond),
   at large shapes while a worker runs the call (see :class:`_Building`);
4. decide the precision it is judged at (declared, or the least precise float it computed in:
   its dtype, or the coarser grid every value it returned lies on; see
   :func:`judged_precision`);
5. judge: the loss first (a different forward cannot be judged against this reference), then
   every row of dE against its rounding bound (at production sizes the rows of absent tokens
   through projections, see ``core.paths.Sketch``), then dW and db; a verdict that
   holds only at the next lower precision is ``precision_limited``, not a path bug;
6. call again, as the kind says: a model after one SGD step with the dE it returned (on the
   first ``SECOND_CALL_POSITIONS`` positions), a kernel on the same inputs.  A tie that is a
   copy, or a gradient buffer never zeroed, is right on the first call and wrong from the
   second on, and is named as such (``tie_is_a_copy``, ``gradient_not_zeroed``).  A first
   call found wrong ends the observation: no second call is judged.  Where the worker
   outranks this process (the command's, which gives way to it), the second call is sent
   before step 5 and runs while this process judges the first; elsewhere it is made after
   step 5, and only for a first call found right (see :func:`observe`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import numpy as np

from tyingspec._src.core import memory, threads
from tyingspec._src.core.adapters import SPILL_ABOVE, AdapterError, Returned, spill
from tyingspec._src.core.cases import PROBE_CASES, Batch, Case, at_shape, build, sgd_step
from tyingspec._src.core.diagnosis import ArrayCheck, Diagnosis, Label, compare, diagnose
from tyingspec._src.core.findings import Finding
from tyingspec._src.core.paths import Paths, closed_form_paths
from tyingspec._src.core.tolerance import (
    LOWER,
    UNIT_ROUNDOFF,
    Precision,
    Terms,
    Tolerance,
    computed_in,
    least_precise,
    row_tolerance,
    value_tolerance,
)
from tyingspec._src.engine.isolation import DEFAULT_TIMEOUT, Worker
from tyingspec._src.kinds.table import Kind, KindSpec, fitting, kind_spec, resolve

PrecisionChoice = Literal["auto", "float64", "float32", "bfloat16", "float16"]
PRECISION_CHOICES: tuple[PrecisionChoice, ...] = get_args(PrecisionChoice)
Stage = Literal["first call", "after one SGD step"]
FIRST_CALL: Stage = "first call"
AFTER_STEP: Stage = "after one SGD step"
Status = Literal["correct", "no_power", "wrong", "adapter_error"]

#: The call after the SGD step sees at most this many positions of the batch: it is there to
#: catch state kept between calls (a copied tie, an unzeroed buffer), which any batch shows,
#: and a short one keeps its cost a small part of a check at production sizes.  16, not 64:
#: the cold command at GPT-2 size on the 2-core VM of docs/speed.md, 2 runs of 10
#: interleaved pairs, median -0.18 s and -0.28 s (7 and 7 of 10 faster); its call and
#: reference are V x d passes either way, but each product on N positions shrinks with N.
#: A copied tie and a buffer never zeroed are still named at that size, and at V=8192,
#: d=256, N=512 in float32 and float64 on all seven cases (bfloat16 has no power there, with
#: 64 positions as with 16).
SECOND_CALL_POSITIONS = 16

#: Who is told the phase an observation is in ("calling", "reference", "judging", "second
#: call"): a front end's progress line (``front.check``), set around its observations by
#: :func:`phases_to`; None, nobody.
_ON_PHASE: ContextVar[Callable[[str], None] | None] = ContextVar("tyingspec_on_phase",
                                                                 default=None)


@contextlib.contextmanager
def phases_to(report: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``report(phase)`` is called as each observation moves on."""
    token = _ON_PHASE.set(report)
    try:
        yield
    finally:
        _ON_PHASE.reset(token)


def _phase(name: str) -> None:
    report = _ON_PHASE.get()
    if report is not None:
        report(name)


@dataclass(frozen=True)
class Target:
    """An adapter resolved in this process: its spec, kind (the ``KindSpec`` itself, read from
    the table when the target was loaded), the callable, the precision."""

    spec: str
    kind: KindSpec
    fn: Callable[..., Any]
    precision: PrecisionChoice = "auto"
    worker: Worker | None = None  # a module:attr target runs in its own process
    # first calls whose batch (and reference) were built while the worker loaded, by case
    _prepared: dict[Case, _Prepared] = field(default_factory=dict, compare=False, repr=False)
    # cases whose first call was found wrong: from the first, no second call is sent ahead
    _wrong_first: list[Case] = field(default_factory=list, compare=False, repr=False)

    def close(self) -> None:
        """Stop the target's worker process, if it has one."""
        self._prepared.clear()
        if self.worker is not None:
            self.worker.stop(wait=False)  # its exit overlaps whatever this process does next

    def __repr__(self) -> str:
        return f"Target({self.spec!r}, {self.kind.name!r}, precision={self.precision!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis' falsifying example would otherwise list the dataclass field by field.
        printer.text(repr(self))


@dataclass(frozen=True)
class _Prepared:
    """A first call's batch, inputs and (when its precision is declared) reference, built
    while the worker loaded (see :func:`load`)."""

    case: Case  # tokens and targets spelled out
    batch: Batch
    inputs: dict[str, Any]
    paths: Paths | _Building | None


class _Building:
    """A first call's reference built on a thread of its own while the worker runs the call,
    in what the call leaves of the cores.  For a worker that outranks this process, the
    reference prepared while it imports the target: the import is the check's critical path
    and the first call the next part of it, so the call is sent as soon as the import is done
    and the reference's rest is built beside it (the cold command at GPT-2 size on the 2-core
    VM of docs/speed.md, 2 runs of 10 interleaved pairs against the reference built before
    the call: median -0.29 s and -0.22 s, 8 and 6 of 10 faster).  For a worker that is this
    process's equal, every call not prepared (see :data:`_BESIDE_CALL_ABOVE`).  A reference
    that fails is built again where the call is judged, to raise there."""

    def __init__(self, build: Callable[[], Paths]) -> None:
        self._paths: Paths | None = None
        # a daemon: a check that ends early (an import error) does not wait for it at exit
        self._thread = threading.Thread(target=self._build, args=(build,), daemon=True,
                                        name="tyingspec-reference")
        self._thread.start()

    def _build(self, build: Callable[[], Paths]) -> None:
        try:
            # On one BLAS thread: beside the import it has the one core the import leaves
            # idle, and beside the call whatever the call leaves; a second thread only waits
            # for a core that is not free, and OpenBLAS's threads wait for each other.  Alone
            # at GPT-2 size on the 2-core VM of docs/speed.md the reference takes about the
            # same CPU seconds either way (1.74-1.85 on two threads, 1.66-1.84 on one); beside
            # the worker, the cold command went from a median 4.46 s to 4.31 s (10
            # interleaved pairs, 10 of 10 faster; another 10 pairs: -0.09 s, 9 of 10).
            with threads.blas_on_one_core():
                self._paths = build()
        except Exception:  # noqa: BLE001  (built again, and raised, by the judgement)
            self._paths = None

    def result(self) -> Paths | None:
        """The reference once built (None if building it failed)."""
        self._thread.join()
        return self._paths


def _reference_from_inputs(target: Target) -> bool:
    """Whether ``target``'s reference can be built from a call's inputs before it returns
    (``KindSpec.reference_first``: a function of the inputs and the precision alone; a torch
    model's is observed in its call): with a declared precision, the first call's is built
    while the worker loads (an import leaves a core idle), and a later call's beside the call
    where the worker is this process's equal (see :data:`_BESIDE_CALL_ABOVE`)."""
    return target.kind.reference_first and target.kind.complete is None


def _reference_of(target: Target, batch: Batch, inputs: dict[str, Any]) -> Callable[[], Paths]:
    """The reference of a call on ``batch``'s ``inputs`` at the declared precision, to build."""
    return functools.partial(target.kind.reference, batch, inputs, target.precision, None)


def _remote(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("this target runs in its worker process: use tyingspec's engine.call")


def load(spec: str, kind: Kind | KindSpec, precision: PrecisionChoice = "auto", *,
         isolate: bool = True, timeout: float = DEFAULT_TIMEOUT,
         paths: tuple[str, ...] = (), prepare: Sequence[Case] = ()) -> Target:
    """Resolve ``spec`` as an adapter of ``kind``; its signature is compared with the kind's
    contract before any call, and a mismatch says which kind it looks like.

    A ``module:attr`` target is imported and called in a worker process (``isolate``), with
    ``paths`` put first on its ``sys.path`` and each call limited to ``timeout`` seconds;
    built-in targets run in-process.  While the worker imports the target (a second or more
    for a module that imports torch), the first calls of the ``prepare`` cases are built: their
    batches, and their references when the precision is declared (on a thread that goes on
    past the import, for a worker that outranks this process: see :class:`_Building`).  Call
    :meth:`Target.close` when done."""
    try:
        table = kind if isinstance(kind, KindSpec) else kind_spec(kind)
    except ValueError as exc:
        raise AdapterError(spec, str(exc)) from None
    worker: Worker | None = None
    prepared: dict[Case, _Prepared] = {}
    if isolate and ":" in spec:
        worker = Worker(spec, table.name, timeout, paths)
        worker.launch()
        try:
            _prepare(Target(spec, table, _remote, precision, worker, prepared), prepare)
            worker.wait_loaded()
        except BaseException:
            worker.stop()
            raise
        fn: Callable[..., Any] = _remote
        problem, fits = worker.signature_problem, worker.fits
    else:
        fn = resolve(spec, table.name)
        problem, fits = fitting(fn, table.name)
    if problem is not None:
        if worker is not None:
            worker.stop()
        hint = (f"; it looks like a {fits[0]} adapter ({kind_spec(fits[0]).contract}): "
                f"rerun with --kind {fits[0]}") if fits else ""
        raise AdapterError(spec, f"does not match the {table.name} contract{hint}",
                           expected=table.contract, got=problem)
    return Target(spec, table, fn, precision, worker, prepared)


def _prepare(target: Target, cases: Sequence[Case]) -> None:
    """Build the first calls of ``cases`` while ``target``'s worker is still loading.  An error
    the worker already reported ends the load at once; a case that cannot be built is left
    for its first call, to fail where it always did."""
    assert target.worker is not None
    if target.kind.own_shape or not _reference_from_inputs(target):
        return
    for case in cases:
        try:
            spelled, batch = batch_for(target, case)
            inputs = target.kind.inputs(batch)
        except Exception:  # noqa: BLE001  (raised again by the first call)
            return
        target.worker.stage(_given(target, inputs))  # the call's blocks, off its path
        target.worker.wait_loaded(block=False)
        paths: Paths | _Building | None = None
        if target.precision != "auto":
            build = _reference_of(target, batch, inputs)
            if target.worker.outranks():
                paths = _Building(build)
            else:
                try:
                    paths = build()
                except Exception:  # noqa: BLE001  (raised again by the first call)
                    paths = None
        target._prepared[case] = _Prepared(spelled, _released(target, batch, inputs), inputs,
                                           paths)


def _released(target: Target, batch: Batch, inputs: dict[str, Any]) -> Batch:
    """The batch without what the kind's inputs no longer need (a kernel's E)."""
    release = target.kind.release
    return batch if release is None else release(batch, inputs)


def declared(target: Target, case: Case) -> Case:
    """The case in the target's declared precision (arrays are built in it)."""
    if target.precision == "auto" or case.dtype == target.precision:
        return case
    return replace(case, dtype=target.precision)


def call(target: Target, batch: Batch, **overrides: Any) -> Returned:
    """Call the target on a batch's inputs for its kind, any of them replaced."""
    return _invoke(target, target.kind.inputs(batch) | overrides)


def _invoke(target: Target, inputs: dict[str, Any]) -> Returned:
    given = _given(target, inputs)
    if target.worker is not None:
        returned: Returned = target.worker.invoke(given)
        return returned
    return target.kind.invoke(target.spec, target.fn, given)


def _given(target: Target, inputs: dict[str, Any]) -> dict[str, Any]:
    """What the adapter is handed: the kind's inputs, and the precision if it takes one."""
    return inputs | {"precision": target.precision} if target.kind.takes_precision else inputs


def reference(target: Target, batch: Batch, *, precision: Precision = "float64",
              **overrides: Any) -> Paths:
    """The two-path reference for the inputs :func:`call` hands over, for a check judged at
    ``precision`` (float64 arithmetic, or float32 at large shapes judged at float32 or below;
    see ``core.cases.working_dtype``)."""
    return target.kind.reference(batch, target.kind.inputs(batch) | overrides, precision, None)


def _judged(target: Target, batch: Batch, inputs: dict[str, Any], precision: Precision,
            returned: Returned, paths: Paths | None = None) -> tuple[Returned, Paths]:
    """The reference of a call (unless already built), and what it returned as judged: a kind
    with its own judgement (``complete``) derives both from the call."""
    if target.kind.complete is not None:
        return target.kind.complete(batch, inputs, precision, returned)
    if paths is None:
        paths = target.kind.reference(batch, inputs, precision, returned)
    return returned, paths


def precision_for(target: Target, *returned: Returned) -> Precision:
    """The precision a comparison is judged at: the declared one, else the least precise one
    the adapter computed in (see :func:`judged_precision`)."""
    return judged_precision(target, *returned)[0]


def judged_precision(target: Target, *returned: Returned) -> tuple[Precision, str]:
    """The precision a comparison is judged at, and why, when that is not the dtype the
    adapter returned ("" otherwise).  The declared one (``--precision``), else the least
    precise of what each returned array was computed in: its dtype, or the coarser grid every
    one of its values lies on (``core.tolerance.computed_in``).  One rule for every kind: a
    correct adapter that computes in float32 and returns float64 (a Triton kernel's float32
    accumulators, a model's ``.double()`` at the end) is within the float32 bound, not the
    float64 one, and was judged ``precision_limited`` (exit 1) at float64."""
    if target.precision != "auto":
        return target.precision, ""
    returned_as = least_precise(*[r.precision for r in returned])
    grids = [(grid, str(a.dtype)) for r in returned
             for a in (r.dE, r.dW, r.db) if a is not None and a.size
             and (grid := computed_in(np.asarray(a))) is not None]
    if not grids:
        return returned_as, ""
    grid, dtype = max(grids, key=lambda g: UNIT_ROUNDOFF[g[0]])
    if UNIT_ROUNDOFF[grid] <= UNIT_ROUNDOFF[returned_as]:
        return returned_as, ""
    return grid, f"every value it returned is a {grid}, though its dtype is {dtype}"


def row_bound(paths: Paths, precision: Precision) -> Tolerance:
    """Each row's rounding bound at ``precision`` (see :mod:`core.tolerance`)."""
    return row_tolerance(paths.bound_terms, precision)


def value_bound(name: str, paths: Paths, precision: Precision) -> Tolerance:
    """The rounding bound of another output (``loss``, ``dW`` or ``db``) on ``paths``: its own
    terms' magnitudes, or the reference value's when the paths carry none."""
    terms = paths.terms or Terms(rows=np.zeros(0), k=1.0)
    magnitude = {"loss": terms.loss or None, "dW": terms.dW, "db": terms.db}[name]
    if magnitude is None:
        magnitude = np.abs(np.asarray(getattr(paths, name), dtype=np.float64))
    return value_tolerance(terms, precision, magnitude)


def other_checks(returned: Returned, paths: Paths, precision: Precision) -> list[ArrayCheck]:
    """The loss, dW and db a model returned, against the reference under their bounds."""
    if returned.loss is None:
        return []
    names = ["loss"] + (["dW"] if returned.dW is not None else []) + \
        (["db"] if paths.db is not None and returned.db is not None else [])
    return [compare(n, getattr(returned, n), getattr(paths, n), value_bound(n, paths, precision))
            for n in names]


def _judge_at(returned: Returned, paths: Paths, precision: Precision) -> Diagnosis:
    others = other_checks(returned, paths, precision)
    diag = diagnose(returned.dE, paths, dtype=precision, others=others,
                    mutated=returned.mutated)
    loss = next((c for c in others if c.name == "loss"), None)
    if loss is not None and not loss.ok:
        # The reference is the probe model's: against another forward no path can be judged.
        diag = replace(diag, label="forward_mismatch", detail=(
            f"your loss differs from the probe model's by {loss.max_abs_error:.3g} "
            f"(reference {paths.loss:.6g}, allowed {loss.tolerance.describe()}); the gradient "
            "cannot be judged against this reference"))
    return diag


def judge(returned: Returned, paths: Paths, precision: Precision) -> Diagnosis:
    """The diagnosis of what an adapter returned, judged at ``precision``."""
    diag = _judge_at(returned, paths, precision)
    lower = LOWER.get(precision)
    if diag.wrong and diag.label != "inputs_mutated" and lower is not None:
        low = _judge_at(returned, paths, lower)
        # only a lower bound that still has power can vouch for the rows ("no power" there
        # means every wrong gradient would pass it too)
        if low.label == "correct":
            diag = replace(diag, label="precision_limited", detail=(
                f"every row within the {lower} bound, beyond the {precision} bound (worst row "
                f"{diag.margin:.3g}x its {precision} bound); rerun with --precision {lower}"))
    return _with_findings(_padding(diag, returned, paths, precision), returned)


def _padding(diag: Diagnosis, returned: Returned, paths: Paths,
             precision: Precision) -> Diagnosis:
    """A declared padding row that is wrong alone: zero (its output path was masked too), or
    holding the input path padding_idx exempts it from (the mask skipped: pytorch #26302)."""
    pad = paths.padding_idx
    if pad is None or not diag.wrong or diag.wrong_rows != [pad]:
        return diag
    actual = np.asarray(returned.dE[pad], dtype=np.float64)
    if not np.any(actual):
        return replace(diag, label="padding_row_masked", detail=(
            f"row {pad} (padding_idx) is zero, but the output path reaches it; padding_idx "
            "exempts the input path only"))
    if paths.pad_input is not None and np.any(paths.pad_input):
        row = np.array([pad])
        unmasked = paths.in_rows(row) + paths.out_rows(row) + paths.pad_input[None, :]
        if row_bound(paths, precision).rows(row).close(actual[None, :], unmasked).all():
            return replace(diag, label="padding_row_unmasked", detail=(
                f"row {pad} (padding_idx) holds the input path of the positions that read it: "
                "the backward skipped the padding mask (the pytorch #26302 family)"))
    return diag


#: Passed checks whose power vouches for rows that had none (see :func:`_with_findings`).
_VOUCHING = ("gradient against the forward", "gradient at every training step")

#: Checks a wrong row outranks: they test the gradient too, and the row diagnosis says more.
_AFTER_ROWS = ("gradient against the forward", "fresh gradient", "micro-batches accumulate",
               "gradient at every training step")


def _with_findings(diag: Diagnosis, returned: Returned) -> Diagnosis:
    """The verdict of a call that ran named checks beyond rows (the torch kind): a broken tie,
    identity or optimizer outranks the rows; the rows outrank the other gradient checks."""
    if not returned.findings:
        return diag
    first = next((f for f in returned.findings if f.failed and f.check not in _AFTER_ROWS),
                 None)
    if first is None and not diag.wrong:
        first = next((f for f in returned.findings if f.failed), None)
    rows_label = diag.label
    vouched = next((f for f in returned.findings if f.check in _VOUCHING
                    and f.outcome == "passed" and f.power), None)
    if first is None and diag.label == "no_power" and vouched is not None:
        # the rows cannot tell at this precision (a bfloat16 model's bound can exceed a row),
        # or are the model's own (uses not observed); the forward check, or the training
        # steps judged over every entry at once, can, and agree
        diag = replace(diag, label="correct", detail=(
            f"{diag.detail}; {vouched.check} has that power (it would fail the gradient "
            "without a path) and agrees"))
    if first is not None:
        label, detail = first.label or "unknown", f"{first.check}: {first.detail}"
        if _summed_exactly(first, diag, returned):
            label = "gradient_disagrees_with_forward"
            detail += ("; yet every row is exactly the sum of the gradients its uses received, "
                       "so the tie summed every use: what disagrees with the forward is the "
                       "gradient reaching the uses (a no_grad, detach or hand-written backward "
                       "inside the model), not how the tie adds them")
        diag = replace(diag, label=label, detail=detail)
    return replace(diag, findings=returned.findings, rows_label=rows_label)


#: Labels the forward check gives from where its wrong rows sit in the batch alone: each says
#: the tie summed its uses wrongly (see ``core.diagnosis.forward_pattern``).
_HOW_THE_TIE_SUMS = ("duplicates_not_accumulated", "input_path_wrong")


def _summed_exactly(first: Finding, diag: Diagnosis, returned: Returned) -> bool:
    """Whether ``first``, a forward check whose wrong rows sit where a mis-summed tie would put
    them (the rows of repeated tokens, of every present token), failed on a call whose every
    row is exactly the sum of its observed uses' gradients: then the tie summed every use, the
    pattern does not explain the rows, and what disagrees with the forward is the gradient
    reaching the uses (transformers' HRM runs part of its forward under no_grad on purpose,
    and its repeated tokens carry the most of that: they were named
    duplicates_not_accumulated, in a sweep of transformers 5.25's causal-LM architectures)."""
    return first.check == "gradient against the forward" and first.label in _HOW_THE_TIE_SUMS \
        and diag.label == "correct" and returned.evidence.get("observed_by") == "uses"


def own_case(target: Target, case: Case) -> Case:
    """``case`` at the target's own shape (see :func:`shape_of`; asked once per target), its
    composition and seed kept: how a property draws batches for a torch model."""
    if target.kind.shape_cases is not None:
        return target.kind.shape_cases(target.spec, described(target), [case])[0][0]
    shape = shape_of(target)
    if shape is None:
        return case
    V, d, N = shape
    if case.tokens is not None:
        return replace(case, V=V, d=d, N=len(case.tokens), probe=False)
    composition = case.composition if case.composition != "distinct" or N <= V else "random"
    distinct = None if case.distinct is None else min(case.distinct, V, N)
    return replace(case, V=V, d=d, N=N, probe=False, e_scale=1.0, composition=composition,
                   distinct=distinct, dtype="float64")


def shape_of(target: Target) -> tuple[int, int, int] | None:
    """A kind whose batch shape is the target's own (a torch model's vocabulary, width and
    batch_size x seq_len): that shape, asked of the target; None for other kinds."""
    if not target.kind.own_shape:
        return None
    tie = described(target)["tie"]
    return int(tie["vocab"]), int(tie["width"]), int(tie["batch_size"]) * int(tie["seq_len"])


_DESCRIBED: dict[tuple[str, str], dict[str, Any]] = {}


def described(target: Target) -> dict[str, Any]:
    """What a target says of itself (a linear-ce kernel: its form and the options it declares),
    asked once per target."""
    key = (target.spec, target.kind.name)
    if key not in _DESCRIBED:
        _DESCRIBED[key] = dict(_invoke(target, {"mode": "describe"}).evidence)
    return _DESCRIBED[key]


def runnable(target: Target, case: Case) -> str | None:
    """Why ``case`` cannot run on ``target`` (it needs an option the target does not declare;
    never silently treated as off); None when it can."""
    if target.kind.unfit is None:
        return None
    return target.kind.unfit(described(target), case)


def shaped(target: Target, cases: list[Case]) -> tuple[list[Case], list[str]]:
    """The cases at the target's own shape (see :func:`shape_of`), those it can run, and notes
    on what changed."""
    if target.kind.unfit is not None:
        unfit = [(c.name, why) for c in cases if (why := runnable(target, c)) is not None]
        cases = [c for c in cases if runnable(target, c) is None]
        notes = [f"left out {name}: {why}" for name, why in unfit]
        if target.kind.shape_cases is None:
            return cases, notes
        cases, more = target.kind.shape_cases(target.spec, described(target), cases)
        return cases, notes + more
    if target.kind.shape_cases is not None:
        return target.kind.shape_cases(target.spec, described(target), cases)
    shape = shape_of(target)
    if shape is None:
        return cases, []
    V, d, N = shape
    asked = {c.N for c in cases if c.given_shape and c.tokens is None}
    if asked:
        # --shape: the model's vocabulary and width, and the positions asked for (a sequence
        # past its context length is the model's own error, reported as such)
        batch = int(described(target)["tie"]["batch_size"])
        wrong = [c for c in cases if c.given_shape and (c.V, c.d) != (V, d)]
        if wrong or any(n % batch for n in asked):
            raise AdapterError(target.spec, "--shape does not fit the model", key="--shape",
                               expected=f"V={V} d={d} (the model's) and N a multiple of its "
                                        f"batch size {batch}",
                               got=f"V={cases[0].V} d={cases[0].d} N={cases[0].N}")
        N = max(asked)
    given = [replace(c, V=V, d=d, N=len(c.tokens or ()), probe=False)
             for c in cases if c.tokens is not None]
    kept, left_out = at_shape([c for c in cases if c.tokens is None and
                               c.name not in PROBE_CASES], V, d, N, target.kind)
    left_out += [c.name for c in cases if c.tokens is None and c.name in PROBE_CASES]
    kept = [replace(c, probe=False, e_scale=1.0) for c in kept] + given
    notes = [f"the model's shape: V={V} d={d} N={N} (batch x sequence)"]
    if left_out:
        notes.append(f"left out at that shape: {', '.join(left_out)}")
    return kept, notes


def status_of(diag: Diagnosis) -> Status:
    if diag.wrong:
        return "wrong"
    return "no_power" if diag.label == "no_power" else "correct"


@dataclass(frozen=True)
class Observation:
    """One case observed: the batch, what came back, the reference and the diagnosis."""

    case: Case  # the case as run, tokens and targets spelled out (what a replay needs)
    batch: Batch
    returned: Returned
    paths: Paths
    precision: Precision
    diagnosis: Diagnosis
    stage: Stage = FIRST_CALL
    inputs: dict[str, Any] = field(default_factory=dict, repr=False)  # what the target got
    # why ``precision`` is not the dtype the target returned ("" when it is): see
    # :func:`judged_precision`
    precision_note: str = ""

    @property
    def status(self) -> Status:
        return status_of(self.diagnosis)

    @property
    def label(self) -> Label:
        return self.diagnosis.label


def batch_for(target: Target, case: Case) -> tuple[Case, Batch]:
    """Step 1: the case's arrays in the target's declared precision, and the case with its
    tokens and targets spelled out (what a failure prints and a replay needs)."""
    case = declared(target, case)
    batch = build(case, target.kind)
    return case.with_batch(batch.tokens, batch.targets), batch


def first_call(target: Target, case: Case, **overrides: Any) -> Observation:
    """Steps 1-5 of the module docstring: one call, judged; ``overrides`` replace inputs of
    the call (a torch property asks for its own checks only)."""
    return _first_judged(target, *_first_made(target, case, **overrides))


def _first_made(target: Target, case: Case, **overrides: Any
                ) -> tuple[Case, Batch, dict[str, Any], Returned, Paths | _Building | None]:
    """Steps 1-2: the first call made (on what was prepared for it while the worker loaded,
    if anything), with its reference if that was prepared too."""
    _phase("calling")
    prepared = None if overrides else target._prepared.pop(case, None)
    if prepared is not None:
        return (prepared.case, prepared.batch, prepared.inputs,
                _invoke(target, prepared.inputs), prepared.paths)
    case, whole = batch_for(target, case)
    inputs = target.kind.inputs(whole) | overrides
    batch = _released(target, whole, inputs)
    if overrides or not _beside_call(target, whole):
        return case, batch, inputs, _invoke(target, inputs), None
    # The worker runs the call while this process builds its reference (see _BESIDE_CALL_ABOVE)
    assert target.worker is not None
    target.worker.submit(_given(target, inputs))
    paths = _Building(_reference_of(target, whole, inputs))
    return case, batch, inputs, target.worker.collect(), paths


#: Multiply-adds of a reference's products (V d N) from which a call made in a worker that is
#: this process's equal (the Python API's, the pytest plugin's) has its reference built beside
#: it, on a thread of its own (:class:`_Building`): the call leaves part of the cores idle,
#: which the reference's one BLAS thread takes.  A warm case at GPT-2 size on the 2-core VM of
#: docs/speed.md, 3 runs of 8-10 interleaved rounds against the reference built after the
#: call: median -0.11 s, -0.16 s and -0.16 s (6 of 8, 7 of 8, 7 of 10 faster); on two BLAS
#: threads in this thread, -0.11 s; on a thread of lower priority, +0.24 s.  Not for a worker
#: that outranks this process (the command's), whose calls leave its reference too little: the
#: whole seven-case command at that size took 1.9 s longer (4 interleaved rounds, 0 of 4
#: faster); there only the first case's reference, which starts beside the import, is built
#: beside the call.  Below this size a thread costs more than the overlap gives back.
_BESIDE_CALL_ABOVE = 2**24


def _beside_call(target: Target, batch: Batch) -> bool:
    """Whether a first call's reference is built while the worker runs the call: its inputs
    are known, the precision is declared, and the products are large enough."""
    E = batch.E
    return (target.worker is not None and target.precision != "auto"
            and _reference_from_inputs(target) and E is not None and E.ndim == 2
            and E.shape[0] * E.shape[1] * batch.tokens.size > _BESIDE_CALL_ABOVE
            and not target.worker.outranks())


def _first_judged(target: Target, case: Case, batch: Batch, inputs: dict[str, Any],
                  returned: Returned, paths: Paths | _Building | None) -> Observation:
    """Steps 3-5: the first call's reference (unless prepared) and its judgement; a first call
    found wrong is remembered on the target (see :func:`_observe_ahead`)."""
    _phase("reference")
    if isinstance(paths, _Building):
        paths = paths.result()
    precision, why = judged_precision(target, returned)
    returned, paths = _judged(target, batch, inputs, precision, returned, paths)
    _phase("judging")
    obs = Observation(case, batch, returned, paths, precision,
                      judge(returned, paths, precision), inputs=inputs, precision_note=why)
    if obs.diagnosis.wrong:
        target._wrong_first.append(case)
    return obs


#: The last dE each target returned, per shape, with its reference's bound terms: a gradient
#: buffer that is never zeroed shows as "this call's dE = the previous call's + the right one",
#: even across cases.  Only the terms of the reference are kept (its whole paths hold the
#: [N, V] g: 0.5 GB at Llama-3's head), and between observations a large dE is set aside in a
#: file (see :func:`_set_aside`).
_LAST: dict[tuple[str, str, tuple[int, ...]], tuple[np.ndarray, Terms | None]] = {}


def _set_aside() -> None:
    """A kept dE of ``adapters.SPILL_ABOVE`` bytes or more, written to an unnamed temporary
    file and kept as a read-only mapping of it: between cases nothing else holds it, and in
    memory it was the largest array the check held beyond the implementation's own (2.1 GB at
    Llama-3's head: the whole seven-case kernel check peaked at 8.67 GiB against the kernel's
    own 4.79, one case at 4.88).  Its pages are read back only when a later call is wrong and
    the stale-buffer hypothesis is tried.  Where the file cannot be written it stays in
    memory; on a tmpfs ``TMPDIR`` the file is memory too."""
    for key, (dE, terms) in list(_LAST.items()):
        if isinstance(dE, np.memmap) or dE.nbytes < SPILL_ABOVE or not dE.flags.c_contiguous:
            continue
        f = spill(dE)
        if f is None:
            continue
        with f:  # the mapping holds a descriptor of its own
            aside = np.memmap(f, dtype=dE.dtype, mode="r", shape=dE.shape)
        _LAST[key] = (aside, terms)


def _remember(target: Target, obs: Observation) -> Observation:
    key = (target.spec, target.kind.name, tuple(obs.returned.dE.shape))
    previous = _LAST.pop(key, None)  # let go before this dE is kept: never two kept at once
    if not (previous is None or not obs.diagnosis.wrong or obs.label == "inputs_mutated" or
            obs.diagnosis.findings):  # a named check decided it, not the rows
        obs = replace(obs, diagnosis=_stale(obs.diagnosis, previous, obs.returned, obs.paths,
                                            obs.precision))
    del previous
    # a copy in its own dtype (an adapter may reuse its buffer); float64 only if ever compared.
    # A worker's dE is already this process's own copy (see Worker.collect), and so is one
    # nothing else can reach (its Returned and this name hold it: core.memory.unshared).
    dE = obs.returned.dE
    kept = target.worker is not None or memory.unshared(dE, holders=2)
    _LAST[key] = (dE if kept else np.array(dE, copy=True), obs.paths.terms)
    return obs


#: Wrong rows a stale-buffer hypothesis is tried on before the whole matrix.
_STALE_ROWS = 256


def _stale(diag: Diagnosis, previous: tuple[np.ndarray, Terms | None], returned: Returned,
           paths: Paths, precision: Precision) -> Diagnosis:
    prev_raw, t0 = previous
    t1 = paths.terms
    if t0 is None or t1 is None or t0.rows.shape != t1.rows.shape:
        return diag
    tol = row_tolerance(Terms(rows=t0.rows + t1.rows, k=max(t0.k, t1.k)), precision)
    # A stale buffer explains every row, so the rows this call got wrong settle most cases
    # first: the whole comparison builds [V, d] float64 matrices and the whole output path
    # (4.7 s a wrong case at GPT-2 size, where the previous call is usually another case's).
    # The answer is the same: those rows are part of the whole comparison.
    few = np.asarray(diag.wrong_rows[:_STALE_ROWS], dtype=np.int64)
    if few.size:
        expected = paths.in_rows(few) + paths.out_rows(few)
        got = (np.asarray(returned.dE[few], dtype=np.float64)
               - np.asarray(prev_raw[few], dtype=np.float64))
        if not tol.rows(few).close(got, expected).all():
            return diag
    prev = prev_raw.astype(np.float64)
    actual = np.asarray(returned.dE, dtype=np.float64)
    if tol.close(actual - prev, paths.dE).all():
        return replace(diag, label="gradient_not_zeroed", detail=(
            "this call returned the previous call's dE plus its own: the gradient buffer is "
            "accumulated into and never zeroed between calls"))
    return diag


def judge_repeat(first: Returned, second: Returned, paths: Paths,
                 precision: Precision) -> Diagnosis:
    """The second of two identical calls, judged: ``gradient_not_zeroed`` when it returned the
    first call's dE plus its own (a buffer accumulated into across calls), as the kind's
    second call is named in :func:`observe`."""
    diag = judge(second, paths, precision)
    if not diag.wrong or diag.findings:
        return diag
    return _stale(diag, (np.asarray(first.dE), paths.terms), second, paths, precision)


def observe(target: Target, case: Case, *, step: bool = True, **overrides: Any
            ) -> Observation:
    """Observe ``target`` on ``case``: the first call and the kind's second call (after one SGD
    step, or a repeat); returns the observation that decides the verdict (the second call's
    when it reveals a bug the first did not).  ``overrides`` replace inputs of the call."""
    _set_aside()  # the last observation's dE, now held by nothing else
    if step and not overrides and not target._wrong_first and target.worker is not None \
            and target.kind.complete is None and target.worker.outranks():
        return _observe_ahead(target, case)
    # Otherwise the second call is made after the first is judged, not beside its judgement:
    # where the two processes share the cores as equals, sending it first shows no steady
    # gain (a warm case at GPT-2 size in the Python API, 3 runs of 8-10 interleaved rounds on
    # the 2-core VM of docs/speed.md: median +0.17 s, -0.40 s and -0.05 s; with the judgement
    # on a thread of lower priority, +0.04 s), and a first call found wrong needs none.
    first = _remember(target, first_call(target, case, **overrides))
    if not step or first.diagnosis.wrong:
        return first
    after = _after_first(target, first.batch, first.inputs, first.returned)
    if after is None:
        return first
    batch, lr, inputs = after
    _phase("second call")
    return _second_judged(target, first, batch, lr, inputs, _invoke(target, inputs))


def _observe_ahead(target: Target, case: Case) -> Observation:
    """:func:`observe` with the second call sent before the first is judged, for a worker that
    outranks this process (the command's, see ``front.entry.NICE``): the worker runs the
    second call while this process judges the first, in what the call leaves of the cores
    (the cold command at GPT-2 size on the 2-core VM of docs/speed.md, 8 and 9 interleaved
    pairs: median -0.11 s and -0.18 s, 7 of 8 and 7 of 9 faster).  The step is taken with
    the dE the first call returned, as it would be after the judgement; a first call found
    wrong has its second call's answer read and dropped, unjudged, as if never made.

    That dropped call is work for nothing, and a wrong target's check is mostly wrong first
    calls (each case, each shrinking step): so once one first call of a target is found
    wrong, its later ones are judged before their second call, as elsewhere (the whole check
    of a torch implementation with its output path halved, at GPT-2 size, took 22.3 s
    before this order and 26.9 s with it on every call, 2 interleaved rounds each)."""
    worker = target.worker
    assert worker is not None
    case, batch, inputs, returned, paths = _first_made(target, case)
    after = _after_first(target, batch, inputs, returned)
    if after is not None:
        worker.submit(_given(target, after[2]))
    try:
        first = _remember(target, _first_judged(target, case, batch, inputs, returned, paths))
    except Exception:
        if after is not None:
            _drop_answer(worker)  # the worker stays, ready for the next case
        raise
    except BaseException:
        # an interrupt: the check ends now, without waiting for the call in flight
        if after is not None:
            worker.stop(wait=False)
        raise
    if after is None:
        return first
    if first.diagnosis.wrong:
        _drop_answer(worker)
        return first
    _phase("second call")
    return _second_judged(target, first, *after, worker.collect())


def _drop_answer(worker: Worker) -> None:
    """Read and drop the answer to a call sent ahead whose observation ended without it: the
    worker is ready for the next call as if that one had never been sent."""
    try:
        worker.collect()
    except AdapterError:
        pass  # judging this call was never asked for; the next call starts a new worker if
        # this one has died


def _after_first(target: Target, batch: Batch, inputs: dict[str, Any], returned: Returned
                 ) -> tuple[Batch, float, dict[str, Any]] | None:
    """Step 6's batch, SGD step size and inputs, from the first call's batch, inputs and what
    it returned: the same for a repeat (step 0), the short batch after one step with the dE
    it returned; None when the kind makes no second call or the step would not move E (or
    would move it by no finite amount)."""
    if target.kind.second_call == "none":
        return None
    if target.kind.second_call == "repeat":
        return batch, 0.0, inputs
    moved = sgd_step(batch, returned.dE)
    if moved is None or not np.isfinite(moved[1]):  # a dE that is not finite is wrong anyway
        return None
    stepped, lr = moved
    keep = min(SECOND_CALL_POSITIONS, stepped.tokens.shape[0])
    short = replace(stepped, tokens=stepped.tokens[:keep], targets=stepped.targets[:keep])
    return short, lr, target.kind.inputs(short)


def _second_judged(target: Target, first: Observation, batch: Batch, lr: float,
                   inputs: dict[str, Any], returned: Returned) -> Observation:
    """Step 6's call judged: a repeat against the first call's reference where it still fits,
    a call after the step against its own, and what a wrong one means named."""
    precision, why = judged_precision(target, returned)
    fits = batch is first.batch and precision == first.precision
    returned, paths = _judged(target, batch, inputs, precision, returned,
                              first.paths if fits else None)
    second = _remember(target, Observation(first.case, batch, returned, paths, precision,
                                           judge(returned, paths, precision), AFTER_STEP,
                                           inputs, why))
    if not second.diagnosis.wrong:
        return first
    if lr and second.label not in ("gradient_not_zeroed", "inputs_mutated"):
        second = replace(second, diagnosis=_copied_tie(second.diagnosis, first, batch, lr,
                                                       returned, precision))
    return second


def _copied_tie(diag: Diagnosis, first: Observation, short: Batch, lr: float,
                returned: Returned, precision: Precision) -> Diagnosis:
    """Right at E and wrong after the step: is it a tie that is two tensors?"""
    actual = np.asarray(returned.dE, dtype=np.float64)
    b0 = first.batch
    # A copied tie: the head U started equal to E and took the step with its own (output
    # path) gradient only; the lookup copy took the whole one.  So U = E1 + lr dE_in, with
    # E1 = E - lr dE the E of this call: the input path is sparse, the output path is not
    # (and at production sizes was never built whole).
    touched = np.unique(b0.tokens)
    U1 = short.E.astype(np.float64)
    U1[touched] += lr * first.paths.in_rows(touched)
    U1 = U1.astype(b0.E.dtype)
    untied = closed_form_paths(short.E.astype(np.float64), b0.W.astype(np.float64),
                               None if b0.b is None else b0.b.astype(np.float64), short.tokens,
                               short.targets, short.res, short.s_in,
                               E_out=U1.astype(np.float64))
    if row_bound(untied, precision).close(actual, untied.dE).all():
        return replace(diag, label="tie_is_a_copy", detail=(
            f"the first call was right; after E <- E - {lr:.3g} dE the gradient equals that of "
            "an untied model whose head took only the output path's step: the two uses are two "
            "tensors that started equal"))
    return diag


def agree(name: str, actual: Any, expected: Any, paths: Paths, precision: Precision,
          factor: float = 1.0) -> np.ndarray:
    """Entrywise agreement of two results of the same quantity (``dE``, ``loss``, ``dW`` or
    ``db``), under that quantity's rounding bound on ``paths`` times ``factor`` (a sum of
    ``factor`` such results): how a metamorphic property compares two calls."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    tol = row_bound(paths, precision) if name == "dE" else value_bound(name, paths, precision)
    atol = np.asarray(tol.atol) * factor
    return np.asarray(np.abs(a - e) <= atol + tol.rtol * np.abs(e))
