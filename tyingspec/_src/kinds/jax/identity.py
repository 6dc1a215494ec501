"""Does the tie survive what a JAX model goes through, and does an optimizer see it once?

Runs inside the worker process.  A JAX parameter tree ties by holding the table in one leaf
read by both uses (an NNX Variable shared by two modules is one leaf after ``nnx.split``).  What
breaks it, and why each check exists:

* a tree holding the table under two paths (``{"embed": E, "head": E}``): ``jax.grad`` gives
  each path its own leaf, and optax (``optax.multi_transform`` labelling both) keeps a state
  slot for each and applies one update per path, so one step leaves two different matrices;
* a training step compiled with ``jax.jit`` that closes over the table (a module captured by
  the step instead of passed to it): the compiled step keeps the value it was traced with as
  a constant, so after the first update one use reads a stale table;
* a checkpoint restored into separate leaves (``flax.serialization``, orbax): the tree comes
  back with two arrays where it had one.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.findings import Finding, failed, not_applicable, passed
from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.discover import Form, Tie, discover, leaf

_ONCE = ("the tied table is one leaf of the tree the optimizer is given, with one state slot "
         "per moment, and one step moves it by exactly one update")
_TIED = "the lookup and the head read one leaf, holding the values saved"
_STEP = ("the table stays one leaf through a jitted training step, and each step's loss is "
         "the model's loss at the parameters it was handed")

#: Steps the jitted-step check runs: a stale table shows from the second.
STEPS = 2
_LR = 0.1


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _f64(x: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float64), dtype=np.float64)


def _unit(tie: Tie) -> float:
    return float(np.finfo(jnp.dtype(tie.dtype)).eps) / 2


def _close(a: np.ndarray, e: np.ndarray, unit: float, count: int) -> bool:
    """Agreement of two computations of one value, each ~``count`` roundings at ``unit``:
    atol from the largest entry, rtol from the entry itself."""
    rtol = 8 * unit * max(count, 1)
    scale = float(np.abs(e).max(initial=0.0))
    return bool(np.all(np.abs(a - e) <= rtol * scale + rtol * np.abs(e) + 1e-300))


def _slots(state: Any, shape: tuple[int, ...]) -> int:
    return sum(1 for x in jax.tree_util.tree_leaves(state) if np.shape(x) == shape)


def optimizer_findings(spec: str, form: Form, tie: Tie, t: Any, y: Any,
                       tr: split.Traced) -> list[Finding]:
    """optax.adamw (closed-form first step) and the target's own optimizer, if it has one."""
    import optax  # type: ignore[import-untyped]

    out = []
    builds: list[tuple[str, Any]] = [
        ("optimizer optax.adamw", lambda p: optax.adamw(1e-3, weight_decay=0.01))]
    if form.target.optimizer is not None:
        builds.append(("optimizer from the target", form.target.optimizer))
    for check, build in builds:
        try:
            out.append(_one_optimizer(check, build, form, tie, t, y))
        except Exception as exc:  # a crash is reported, not propagated
            if build is form.target.optimizer:
                raise AdapterError(spec, "the target's optimizer raised", key="optimizer",
                                   got=_raised(exc)) from exc
            out.append(not_applicable(check, _ONCE, f"the check raised {_raised(exc)}"))
    return out


def _one_optimizer(check: str, build: Any, form: Form, tie: Tie, t: Any, y: Any) -> Finding:
    import optax

    params = form.params
    tx = build(params)

    @jax.jit
    def one_step(p: Any) -> tuple[Any, Any, Any]:
        # compiled: run op by op, an optax step costs seconds of per-operation compiles
        state = tx.init(p)
        grads = jax.grad(form.loss)(p, t, y)
        updates, _ = tx.update(grads, state, p)
        return state, grads, optax.apply_updates(p, updates)

    state, grads, new = one_step(params)
    shape = (tie.vocab, tie.width)
    slots = _slots(state, shape)
    tables = _slots(params, shape)
    if tie.how == "two paths, one array":
        apart = float(np.abs(_f64(leaf(new, tie.embedding)) - _f64(leaf(new, tie.head))).max())
        return failed(check, _ONCE, "optimizer_sees_tie_twice",
                      f"the tree holds the table under two paths, {tie.embedding} and "
                      f"{tie.head}: jax.grad gives each its own path's gradient, the optimizer "
                      f"keeps {slots} state slots of its shape and applies one update per path "
                      f"(after one step the two paths differ by max |diff| {apart:.3g}); tie "
                      "in one leaf read by both uses")
    if check != "optimizer optax.adamw":
        return passed(check, _ONCE, f"{slots} state slots of the table's shape for {tables} "
                      "such leaf(s); update size not checked (no closed form for the "
                      "target's optimizer)")
    E0, g = _f64(leaf(params, tie.embedding)), _f64(leaf(grads, tie.embedding))
    lr, wd, eps = 1e-3, 0.01, 1e-8
    # step 1 of AdamW: the bias corrections cancel, m / (sqrt(v) + eps) = g / (|g| + eps)
    expected = E0 - lr * (g / (np.abs(g) + eps) + wd * E0)
    got = _f64(leaf(new, tie.embedding))
    if _close(got, expected, _unit(tie), 32):
        return passed(check, _ONCE, f"moved by exactly one update; {slots} state slots of "
                      f"the table's shape for {tables} such leaf(s)")
    update = expected - E0
    moved = float(((got - E0) * update).sum() / max(float((update * update).sum()), 1e-300))
    return failed(check, _ONCE, "optimizer_sees_tie_twice" if moved > 1.5 else "unknown",
                  f"one step moved the table by {moved:.2f} updates")


def identity_findings(spec: str, form: Form, tie: Tie, t: Any, y: Any,
                      tr: split.Traced) -> list[Finding]:
    """The tie through a jitted training step, a flax.serialization and an orbax round trip."""
    checks: list[tuple[str, str, Any]] = [
        ("identity through a jitted step", _STEP, lambda: _jitted(spec, form, tie, t, y, tr)),
              ("identity after a flax.serialization round trip", _TIED,
               lambda: _serialization(spec, form, tie)),
              ("identity after an orbax round trip", _TIED, lambda: _orbax(spec, form, tie))]
    out = []
    for check, invariant, run in checks:
        try:
            out.append(run())
        except AdapterError:
            raise
        except Exception as exc:  # the transformation itself failed: nothing to look at
            out.append(not_applicable(check, invariant,
                                      f"the transformation raised {_raised(exc)}"))
    return out


def _default_step(form: Form) -> Any:
    @jax.jit
    def step(p: Any, t: Any, y: Any) -> tuple[Any, Any]:
        loss, g = jax.value_and_grad(form.loss)(p, t, y)
        return jax.tree_util.tree_map(lambda a, b: a - _LR * b, p, g), loss
    return step


def _jitted(spec: str, form: Form, tie: Tie, t: Any, y: Any, tr: split.Traced) -> Finding:
    check = "identity through a jitted step"
    own = form.target.step is not None
    try:
        step = form.target.step(form.params) if form.target.step is not None else \
            _default_step(form)
    except Exception as exc:
        raise AdapterError(spec, "the target's make_step raised", key="step",
                           got=_raised(exc)) from exc
    whose = "the target's step" if own else "a jax.jit SGD step"
    a, b = tr.paths.index(tie.embedding), tr.paths.index(tie.head)
    history = [form.params]
    p = form.params
    unit = _unit(tie)
    loss_at = jax.jit(form.loss)
    for i in range(STEPS):
        try:
            p, reported = step(p, t, y)
        except Exception as exc:
            raise AdapterError(spec, "the training step raised", key="step",
                               got=_raised(exc)) from exc
        handed = history[-1]
        true = float(loss_at(handed, t, y))
        count = int(np.size(t)) * tie.width
        if not _close(np.asarray(float(reported)), np.asarray(true), unit, count):
            E_now = leaf(handed, tie.embedding)
            E_then = leaf(form.params, tie.embedding)
            # the other leaves as handed: only the table's two uses are told apart
            staler = jax.jit(split.split_loss(split.trace(form.loss, handed, t, y), a, b))
            for use, args in (("head", (E_now, E_then)), ("lookup", (E_then, E_now))):
                if _close(np.asarray(float(reported)),
                          np.asarray(float(staler(*args))), unit, count):
                    return failed(check, _STEP, "tie_lost",
                                  f"at step {i + 1} of {whose} the loss ({float(reported):.8g})"
                                  f" is the loss with the {use} reading the table as it was "
                                  f"when the step was traced, not the one handed to it "
                                  f"({true:.8g}): the compiled step closes over a stale table "
                                  "(pass the table in, or close over nothing)")
            return failed(check, _STEP, "unknown",
                          f"at step {i + 1} of {whose} the loss {float(reported):.8g} is not "
                          f"the model's loss at the parameters it was handed ({true:.8g})")
        history.append(p)
    structure: Any = jax.tree_util.tree_structure(p)
    if structure != jax.tree_util.tree_structure(form.params):
        raise AdapterError(spec, "the training step returned another tree", key="step",
                           expected=str(jax.tree_util.tree_structure(form.params))[:120],
                           got=str(structure)[:120])
    if tie.how == "two paths, one array":
        apart = float(np.abs(_f64(leaf(p, tie.embedding)) - _f64(leaf(p, tie.head))).max())
        if apart > 0:
            return failed(check, _STEP, "tie_lost",
                          f"after {STEPS} steps of {whose}, {tie.embedding} and {tie.head} "
                          f"hold different matrices (max |diff| {apart:.3g})")
    return passed(check, _STEP, f"{STEPS} steps of {whose}")


def _marked(form: Form, tie: Tie) -> tuple[Any, np.ndarray]:
    """The parameters with the table shifted (one array, under every path that holds it), so
    that a restore which keeps the fresh model's own values is caught."""
    E = leaf(form.params, tie.embedding)
    shifted = E + jnp.linspace(1.0, 2.0, E.size, dtype=E.dtype).reshape(E.shape)
    names = {tie.embedding} | ({tie.head} if tie.how == "two paths, one array" else set())
    tree = jax.tree_util.tree_map_with_path(
        lambda path, x: shifted if split.path_text(path) in names else x, form.params)
    return tree, _f64(shifted)


def _restored_tie(spec: str, check: str, form: Form, tie: Tie, restored: Any,
                  saved: np.ndarray, how: str) -> Finding:
    reloaded = form.reload(restored)
    again, _, _ = discover(spec, replace(form, params=reloaded))
    if again.how != tie.how or again.embedding != tie.embedding:
        return failed(check, _TIED, "tie_lost",
                      f"after {how}, the lookup reads {again.embedding} and the head "
                      f"{again.head} ({again.how}; before: {tie.how})")
    got = _f64(leaf(reloaded, tie.embedding))
    if got.shape != saved.shape or not np.array_equal(got, saved):
        return failed(check, _TIED, "tie_lost",
                      f"after {how}, {tie.embedding} does not hold the saved values")
    return passed(check, _TIED, f"{how} into a fresh model" if form.kind == "nnx" else how)


def _serialization(spec: str, form: Form, tie: Tie) -> Finding:
    from flax import nnx, serialization

    check = "identity after a flax.serialization round trip"
    marked, saved = _marked(form, tie)
    if form.kind == "nnx":
        # an nnx.State is saved as the pure dict its checkpoints hold, and put back into it
        template = nnx.to_pure_dict(form.params)
        pure = serialization.from_bytes(template, serialization.to_bytes(
            nnx.to_pure_dict(marked)))
        restored = jax.tree_util.tree_map(lambda x: x, form.params)
        nnx.replace_by_pure_dict(restored, pure)
    else:
        restored = serialization.from_bytes(form.params, serialization.to_bytes(marked))
    return _restored_tie(spec, check, form, tie, restored, saved,
                         "flax.serialization to_bytes/from_bytes")


#: An orbax round trip slower than this (its async machinery on a busy machine) is reported
#: as such instead of being repeated per worker.
ORBAX_SECONDS = 20.0


def _orbax(spec: str, form: Form, tie: Tie) -> Finding:
    check = "identity after an orbax round trip"
    try:
        import orbax.checkpoint as ocp  # type: ignore[import-untyped]
    except ImportError:
        return not_applicable(check, _TIED, "orbax-checkpoint is not installed: pip install "
                                            "orbax-checkpoint")
    marked, saved = _marked(form, tie)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, marked)
            ckptr.wait_until_finished()
            restored = ckptr.restore(path, form.params)
    took = time.perf_counter() - start
    found = _restored_tie(spec, check, form, tie, restored, saved,
                          "orbax StandardCheckpointer save/restore")
    return replace(found, detail=f"{found.detail} ({took:.2f} s)")
