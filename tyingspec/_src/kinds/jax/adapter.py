"""The jax kind's call: one batch through a user's JAX model, everything observed.

Runs in the worker, where the user's code runs; switches on JAX's float64
(``jax_enable_x64``) there, so that a model can be judged, and differenced, in float64 (a
model keeps the dtype its parameters are made in unless ``--precision`` asks for another).
What it hands back is plain data: the tied leaf's own gradient (``jax.grad`` of the target's
loss, through the target's own ``custom_vjp`` backwards: the gradient that trains), the
``dx``, ``h`` and ``g`` recorded at the table's uses by the split evaluation (see
:mod:`kinds.jax.split`, which never runs the target's backward), and one
:class:`~core.findings.Finding` per check beyond rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from tyingspec._src.core.adapters import AdapterError, Returned, model_batch
from tyingspec._src.core.findings import (
    Finding,
    not_applicable,
    uses_unobserved,
)
from tyingspec._src.core.forward_check import Reference, judge_against_forward
from tyingspec._src.core.process_state import in_worker, jax_state_kept
from tyingspec._src.core.tolerance import precision_of, unit_of
from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.discover import (
    PLACEHOLDER,
    Form,
    Tie,
    as_target,
    build_form,
    cast,
    discover,
    leaf,
)
from tyingspec._src.kinds.jax.identity import identity_findings, optimizer_findings
from tyingspec._src.kinds.jax.setting import parse
from tyingspec._src.kinds.jax.shape import fitted, low_dtype
from tyingspec._src.kinds.jax.split import f64 as _f64

_T = TypeVar("_T")

#: The checks one call can run; a property asks for its own, ``tyingspec check`` for all.
CHECKS = ("optimizer", "identity", "gradient", "forward")

#: Optimizer and identity findings per target, once per worker: they do not depend on the
#: batch, and they are the slow part of a call (each compiles a step).
_STRUCTURAL: dict[tuple[str, str, str], list[Finding]] = {}


#: Per worker, what a target compiles, kept for every later call on it: its Form (built once
#: per target object and precision), and per Form (``id`` -> the Form and its entries) the
#: traces, the compiled gradient and the float64 loss of each batch shape.  The tokens and
#: targets are arguments of everything compiled, so a case of a shape already seen compiles
#: nothing (a check used to recompile on every call: the tokens were constants of the trace).
_FORMS: dict[tuple[str, str], tuple[Any, Form]] = {}
_PER_FORM: dict[int, tuple[Form, dict[Any, Any]]] = {}


def _form(spec: str, fn: Any, target: Any, precision: str) -> Form:
    kept = _FORMS.get((spec, precision))
    if kept is not None and kept[0] is fn:
        return kept[1]
    form = build_form(spec, target, precision)
    _FORMS[(spec, precision)] = (fn, form)
    return form


def _memo(form: Form, key: Any, make: Callable[[], _T]) -> _T:
    """``make()``, once per ``form`` and ``key``."""
    entries = _PER_FORM.setdefault(id(form), (form, {}))[1]
    if key not in entries:
        entries[key] = make()
    out: _T = entries[key]
    return out


def _shape(*xs: Any) -> tuple[Any, ...]:
    return tuple((tuple(np.shape(x)), str(jnp.asarray(x).dtype)) for x in xs)


def _discover(spec: str, form: Form, t: Any = None, y: Any = None
              ) -> tuple[Tie, Finding, split.Traced]:
    """:func:`discover`, once per form and batch shape (the trace takes the batch as
    arguments)."""
    return _memo(form, ("discover", None if t is None else _shape(t, y)),
                 lambda: discover(spec, form, t, y))


def _x64() -> None:
    jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]


#: XLA's CPU backend without LLVM's optimisations: compiling is most of a check of a small
#: model (a check compiles its loss, split, float64 forward and step per batch shape and
#: dtype; ``docs/speed.md`` has what these flags saved).  They change how fast the code
#: runs, not what it computes (XLA's CPU fast math is off, so no level reassociates floats);
#: the jax tests have always run under them.
CHEAP_COMPILES = ("--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true")


def _cheap_compiles() -> None:
    """:data:`CHEAP_COMPILES` in ``XLA_FLAGS``, each the user has not set, in a worker whose
    JAX backend has not started yet (XLA reads the flags then); never in the user's own
    process (an in-process check, the plugin's), where they would outlive the check."""
    if not in_worker():
        return
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)  # private: may go
    if started is None or started():
        return
    user = os.environ.get("XLA_FLAGS", "")
    ours = [f for f in CHEAP_COMPILES if f.split("=")[0] not in user]
    os.environ["XLA_FLAGS"] = " ".join([*ours, user]).strip()


def call_jax(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the model (``inputs["mode"] == "describe"``) or observe it on a batch; JAX's
    float64 switch is as it was afterwards (see :mod:`core.process_state`)."""
    _cheap_compiles()
    with jax_state_kept():
        return _call(spec, fn, inputs)


def _call(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    _x64()
    target = as_target(spec, fn)
    precision = str(inputs.get("precision", "auto"))
    form = _form(spec, fn, target, precision)
    target = form.target
    tie, found, tr = _discover(spec, form)
    if inputs.get("mode") == "describe":
        return _described(form, tie, found, tr)
    try:
        setting = parse(str(inputs.get("setting", "")))
    except ValueError as exc:
        raise AdapterError(spec, str(exc), key="setting") from None
    tokens, targets = model_batch(spec, inputs, setting.B or tie.batch_size, tie.vocab)
    t, y = jnp.asarray(tokens), jnp.asarray(targets)
    tie, found, tr = _discover(spec, form, t, y)
    checks = tuple(inputs.get("checks", CHECKS))
    findings: list[Finding] = [found]
    if found.failed:  # a copy: two leaves, nothing to keep identical
        checks = tuple(c for c in checks if c not in ("identity", "optimizer"))
    # The optimizer and identity checks judge the tree, the optimizer and the step, not the
    # batch: they run on the placeholder's shape cut from it (the jitted-step check allows
    # the loss a rounding that grows with its tokens: at a thousand, more than one SGD step
    # of a stale table changes it by), in the table's own dtype (what the optimizer and the
    # checkpoints hold).
    cut = (slice(target.batch_size or PLACEHOLDER[0]), slice(target.seq_len or PLACEHOLDER[1]))
    t_cut, y_cut = (jnp.asarray(np.asarray(x)[cut]) for x in (t, y))  # numpy: no compile
    for group in ("optimizer", "identity"):
        if group in checks:
            findings += _structural(spec, form, tie, group, t_cut, y_cut, precision, tr)
    if setting.table and precision == "auto" and setting.table != tie.dtype:
        form, tie, tr, refused = _memo(
            form, ("table in", setting.table, _shape(t, y)),
            lambda: _table_in(spec, form, tie, tr, setting.table, t, y))
        findings += refused
    own_precision = _own_precision(tie)
    a, b = tr.paths.index(tie.embedding), tr.paths.index(tie.head)
    try:
        grad = _memo(form, "grad", lambda: jax.jit(jax.value_and_grad(form.loss)))
        value, grads = grad(form.params, t, y)
    except Exception as exc:
        raise AdapterError(spec, "jax.grad of the model's loss raised", key="forward",
                           got=f"{type(exc).__name__}: {exc}") from exc
    own = _f64(leaf(grads, tie.embedding))
    if tie.how == "two paths, one array":
        # the table's gradient when a step sums the two paths' leaves (the optimizer check
        # says what a step that does not sum them does)
        own = own + _f64(leaf(grads, tie.head))
    obs = split.observe(tr, a, b, (t, y))
    evidence: dict[str, Any] = {"tie": asdict(tie), "lookups": obs.lookups,
                                "heads": obs.heads}
    if obs.problem is None:
        evidence.update(observed_by="uses", tokens=obs.ids, dx=obs.dx, h=obs.h, g=obs.g)
    else:
        evidence.update(observed_by="split", dE_in=obs.dE_in, why=obs.problem)
        findings.append(uses_unobserved(
            f"a use of the table cannot be observed ({obs.problem}); the tied gradient is "
            "checked against the forward instead"))
    if "forward" in checks:
        findings.append(_against_forward(form, tie, t, y, own, int(inputs.get("seed", 0)),
                                         obs))
    return Returned(own, (), own_precision, loss=float(value), evidence=evidence,
                    findings=tuple(findings))


def _own_precision(tie: Tie) -> Any:
    return precision_of(tie.dtype if tie.dtype in ("float64", "float32", "bfloat16",
                                                   "float16") else "float32")


def _described(form: Form, tie: Tie, found: Finding, tr: split.Traced) -> Returned:
    """What the target says of itself: its tie, the largest batch a check runs on it, and the
    lower dtype its table runs in (a case drawn to run it there runs in a declared precision
    instead, as every case does)."""
    B, T, note = fitted(form, tie, tr)
    described = replace(tie, batch_size=B, seq_len=T)
    return Returned(np.zeros((0, 0)), (), _own_precision(tie),
                    evidence={"tie": asdict(described), "shape_note": note,
                              "fixed_batch": form.target.seq_len is not None,
                              "low_dtype": low_dtype(tie, tr)},
                    findings=(found,))


_IN_DTYPE = "the model runs with its table in each dtype it runs it in"


def _table_in(spec: str, form: Form, tie: Tie, tr: split.Traced, dtype: str, t: Any, y: Any
              ) -> tuple[Form, Tie, split.Traced, list[Finding]]:
    """The model with its table (the one array under every path that holds it) in ``dtype``,
    rediscovered; where the model does not take a table of another dtype than its other
    parameters, every floating leaf in it; where it takes neither, the model as it is and a
    finding that says so."""
    want = jnp.dtype(dtype)
    names = {tie.embedding, tie.head}
    table = leaf(form.params, tie.embedding)
    one = table.astype(want)
    shared = tie.how == "two paths, one array"

    def put(path: Any, x: Any) -> Any:
        name = split.path_text(path)
        if name in names:
            return one if shared or name == tie.embedding else x.astype(want)
        return x

    tried = []
    for params in (jax.tree_util.tree_map_with_path(put, form.params),
                   cast(form.params, want)):
        moved = replace(form, params=params)
        try:
            again, _, traced = discover(spec, moved, t, y)
            # its backward too (a custom_vjp returning another dtype than its input's):
            # traced, not run
            jax.eval_shape(jax.grad(moved.loss), params, t, y)
            return moved, again, traced, []
        except Exception as exc:  # noqa: BLE001  (what the loss raises in that dtype)
            tried.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
    return form, tie, tr, [not_applicable(
        f"table in {dtype}", _IN_DTYPE,
        f"the loss does not take the table in {dtype} ({'; '.join(tried)}): this case ran "
        f"it in {tie.dtype}")]



def _structural(spec: str, form: Form, tie: Tie, group: str, t: Any, y: Any,
                precision: str, tr: split.Traced) -> list[Finding]:
    key = (spec, group, precision)
    if key not in _STRUCTURAL:
        run = identity_findings if group == "identity" else optimizer_findings
        _STRUCTURAL[key] = run(spec, form, tie, t, y, tr)
    return _STRUCTURAL[key]


def _against_forward(form: Form, tie: Tie, t: Any, y: Any, own: np.ndarray, seed: int,
                     obs: split.Observed) -> Finding:
    """``own`` against directional differences of the loss in float64 (the parameters cast,
    the forward compiled once), judged by :mod:`core.forward_check`; a pass is checked for
    power on ``own`` without its input path.

    A table held below float64 is judged against the float64 loss, whose gradient the
    table's own dtype misses by more than its unit roundoff: a row sums one term per read of
    its token and the output path's contraction over the batch (a float32 row read 1024 times
    was off by 491 units), and an ill-conditioned forward (a softmax saturated on a batch the
    model already fits: ``g = p - 1`` from two numbers close to 1) by more still.  So a row
    that disagrees is condemned only where ``own`` is not, within that row's rounding
    (:func:`_row_rtol`), JAX's own gradient of the target's forward in its own dtypes (every
    ``custom_vjp`` inlined: the split's two paths), which has the same rounding and no
    backward of the target's."""
    params64, loss64 = _memo(form, ("loss64", tie.embedding, tie.head, tie.how),
                             lambda: _loss64(form, tie))
    E0 = np.asarray(leaf(params64, tie.embedding), dtype=np.float64)

    def loss_along(rows: np.ndarray, D: np.ndarray, step: float) -> float:
        E = E0.copy()
        E[np.asarray(rows, dtype=np.int64)] += step * np.asarray(D, dtype=np.float64)
        return float(loss64(jnp.asarray(E), t, y))

    reads = np.asarray(t).reshape(-1)
    return judge_against_forward(
        loss_along, own, check="gradient against the forward", seed=seed, reads=reads,
        vocab=tie.vocab,
        # the rounding the loss really has: a module that computes in float32 whatever its
        # parameters' dtype (nnx.Embed's own dtype) is differenced at float32
        loss_precision=_memo(form, ("computes in", _shape(t, y)), lambda: split.least_precise(
            split.trace(form.loss, params64, t, y))),
        grad_dtype=tie.dtype, e_scale=float(E0.std()) or 1.0,
        input_reached=obs.input_reached, output_reached=obs.output_reached,
        input_path=obs.dE_in,
        same_rounding=Reference(obs.dE_in + obs.dE_out,
                                _row_rtol(reads, tie, obs.logits_dtype), tie.dtype))


def _loss64(form: Form, tie: Tie) -> tuple[Any, Any]:
    """The parameters in float64 and the loss of the table, tokens and targets, compiled (one
    compile per batch shape)."""
    params64 = cast(form.params, jnp.float64)
    both = tie.how == "two paths, one array"

    def with_table(E: Any) -> Any:
        def put(path: Any, x: Any) -> Any:
            name = split.path_text(path)
            return E if name == tie.embedding or (both and name == tie.head) else x
        return jax.tree_util.tree_map_with_path(put, params64)

    return params64, jax.jit(lambda E, tt, yy: form.loss(with_table(E), tt, yy))


def _row_rtol(reads: np.ndarray, tie: Tie, logits_dtype: str) -> np.ndarray:
    """Each row's relative rounding against JAX's own gradient of the same forward: one
    rounding per read of its token and per product of the width in the table's dtype (the
    lookup's scatter-add), and the output path's contraction over the batch in the dtype the
    logits are computed in (a float32 head over a bfloat16 table contracts in float32), both
    counted in full (Higham's ``gamma_k``) and doubled (two computations)."""
    u_table, u_head = unit_of(tie.dtype), unit_of(logits_dtype)
    counts = np.bincount(reads, minlength=tie.vocab).astype(np.float64)
    return 2 * u_table * (tie.width + counts + 1) + 2 * u_head * (tie.width + reads.size)
