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

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tyingspec._src.core.adapters import AdapterError, Returned, model_batch
from tyingspec._src.core.diagnosis import forward_pattern
from tyingspec._src.core.findings import Finding, failed, passed, uses_unobserved
from tyingspec._src.core.process_state import jax_state_kept
from tyingspec._src.core.tolerance import precision_of
from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.discover import (
    Form,
    Tie,
    as_target,
    build_form,
    cast,
    discover,
    leaf,
)

#: The checks one call can run; a property asks for its own, ``tyingspec check`` for all.
CHECKS = ("optimizer", "identity", "gradient", "forward")

#: Optimizer and identity findings per target, once per worker: they do not depend on the
#: batch, and they are the slow part of a call (each compiles a step).
_STRUCTURAL: dict[tuple[str, str, str], list[Finding]] = {}


def _x64() -> None:
    jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]


def call_jax(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the model (``inputs["mode"] == "describe"``) or observe it on a batch; JAX's
    float64 switch is as it was afterwards (see :mod:`core.process_state`)."""
    with jax_state_kept():
        return _call(spec, fn, inputs)


def _call(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    _x64()
    target = as_target(spec, fn)
    precision = str(inputs.get("precision", "auto"))
    form = build_form(spec, target, precision)
    tie, found, _ = discover(spec, form)
    own_precision = precision_of(tie.dtype if tie.dtype in ("float64", "float32", "bfloat16",
                                                            "float16") else "float32")
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), own_precision, evidence={"tie": asdict(tie)},
                        findings=(found,))
    tokens, targets = model_batch(spec, inputs, tie.batch_size, tie.vocab)
    t, y = jnp.asarray(tokens), jnp.asarray(targets)
    tie, found, tr = discover(spec, form, t, y)
    checks = tuple(inputs.get("checks", CHECKS))
    findings: list[Finding] = [found]
    if found.failed:  # a copy: two leaves, nothing to keep identical
        checks = tuple(c for c in checks if c not in ("identity", "optimizer"))
    for group in ("optimizer", "identity"):
        if group in checks:
            findings += _structural(spec, form, tie, group, t, y, precision, tr)
    a, b = tr.paths.index(tie.embedding), tr.paths.index(tie.head)
    try:
        value, grads = jax.jit(jax.value_and_grad(form.loss))(form.params, t, y)
    except Exception as exc:
        raise AdapterError(spec, "jax.grad of the model's loss raised", key="forward",
                           got=f"{type(exc).__name__}: {exc}") from exc
    own = _f64(leaf(grads, tie.embedding))
    if tie.how == "two paths, one array":
        # the table's gradient when a step sums the two paths' leaves (the optimizer check
        # says what a step that does not sum them does)
        own = own + _f64(leaf(grads, tie.head))
    obs = split.observe(tr, a, b)
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
                                         obs.dE_in))
    return Returned(own, (), own_precision, loss=float(value), evidence=evidence,
                    findings=tuple(findings))


def _f64(x: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float64), dtype=np.float64).copy()


def _structural(spec: str, form: Form, tie: Tie, group: str, t: Any, y: Any,
                precision: str, tr: split.Traced) -> list[Finding]:
    key = (spec, group, precision)
    if key not in _STRUCTURAL:
        from tyingspec._src.kinds.jax.identity import identity_findings, optimizer_findings

        run = identity_findings if group == "identity" else optimizer_findings
        _STRUCTURAL[key] = run(spec, form, tie, t, y, tr)
    return _STRUCTURAL[key]


def fd_budget(V: int) -> int:
    """Forward evaluations one localisation may spend (as the torch kind's: about five wrong
    rows localised at any V)."""
    return int(200 + 60 * np.log2(max(V, 2)))


_AGAINST = ("the tied gradient agrees with directional central differences of the loss, row "
            "sets split until the disagreeing rows are found")


def _against_forward(form: Form, tie: Tie, t: Any, y: Any, own: np.ndarray, seed: int,
                     input_path: np.ndarray) -> Finding:
    """``own`` against directional differences of the loss in float64 (the parameters cast,
    the forward compiled once); a pass is checked for power on ``own - input_path``."""
    from tyingspec._src.core.localize import BudgetExceeded, fails_without, localize

    check = "gradient against the forward"
    params64 = cast(form.params, jnp.float64)
    both = tie.how != "one leaf"

    def with_table(E: Any) -> Any:
        def put(path: Any, x: Any) -> Any:
            name = split.path_text(path)
            if name == tie.embedding or (both and name == tie.head and
                                         tie.how == "two paths, one array"):
                return E
            return x
        return jax.tree_util.tree_map_with_path(put, params64)

    loss64 = jax.jit(lambda E: form.loss(with_table(E), t, y))
    E0 = np.asarray(leaf(params64, tie.embedding), dtype=np.float64)
    e_scale = float(E0.std()) or 1.0

    def loss_along(rows: np.ndarray, D: np.ndarray, step: float) -> float:
        E = E0.copy()
        E[np.asarray(rows, dtype=np.int64)] += step * np.asarray(D, dtype=np.float64)
        return float(loss64(jnp.asarray(E)))

    # the rounding the loss really has: a module that computes in float32 whatever its
    # parameters' dtype (nnx.Embed's own dtype) is differenced at float32
    low = split.least_precise(split.trace(form.loss, params64, t, y))
    unit = float(np.finfo(low).eps) / 2
    own_unit = float(np.finfo(jnp.dtype(tie.dtype)).eps) / 2
    grad_rtol = max(2.0**-40, 16 * own_unit)
    budget = fd_budget(tie.vocab)
    reads = np.asarray(t).reshape(-1)
    try:
        found = localize(loss_along, own, seed=seed, max_evaluations=budget, e_scale=e_scale,
                         unit=unit, grad_rtol=grad_rtol)
    except BudgetExceeded as exc:
        label, why = forward_pattern(list(exc.found), reads, tie.vocab, partial=True)
        return failed(check, _AGAINST, label,
                      f"rows {list(exc.found)[:16]} (and {exc.unresolved} rows not yet "
                      f"decided) disagree with the forward{why} (stopped at the budget of "
                      f"{budget} forward evaluations)", budget)
    at = f"loss at unit roundoff {unit:.2g}"
    if not found.wrong_rows:
        if found.worst > 1:
            return failed(check, _AGAINST, "gradient_disagrees_with_forward",
                          f"a set of rows disagreed with the forward ({found.worst:.3g}x its "
                          f"tolerance) but no single row could be confirmed; {at}, "
                          f"{found.evaluations} forward evaluations", found.evaluations)
        power = fails_without(loss_along, own, input_path, seed=seed,
                              max_evaluations=budget, e_scale=e_scale, unit=unit,
                              grad_rtol=grad_rtol)
        return passed(check, _AGAINST, f"{found.evaluations} forward evaluations, {at}"
                      + ("; it fails the gradient without its input path" if power else ""),
                      found.evaluations, power)
    label, why = forward_pattern(list(found.wrong_rows), reads, tie.vocab)
    return failed(check, _AGAINST, label,
                  f"rows {list(found.wrong_rows)[:16]} disagree with the forward{why} "
                  f"({found.evaluations} forward evaluations, {at})", found.evaluations)

