"""Does the tie survive what a JAX model goes through, and does an optimizer see it once?

Runs inside the worker process.  A JAX parameter tree ties by holding the table in one leaf
read by both uses (an NNX Variable shared by two modules is one leaf after ``nnx.split``).  What
breaks it, and why each check exists:

* a tree holding the table under two paths (``{"embed": E, "head": E}``): ``jax.grad`` gives
  each path its own leaf, and optax (``optax.multi_transform`` labelling both) keeps a state
  slot for each and applies one update per path, so one step leaves two different matrices;
* an optimizer that holds the one leaf but does not step it once: ``optax.masked`` with a
  mask that leaves the table out (its gradient passes through as its update, and
  ``apply_updates`` adds it: an ascent step), a zero transform for its label (never
  stepped), parameter groups summed with the table in two of them (stepped twice).  Counting
  state slots sees none of these, so the update the table receives is replayed with the
  optimizer's own math (:func:`_judge_replayed`);
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
from tyingspec._src.core.tolerance import unit_of
from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.discover import Form, Tie, discover, leaf
from tyingspec._src.kinds.jax.split import f64 as _f64

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



def _unit(tie: Tie) -> float:
    return unit_of(tie.dtype)


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


#: Other leaves the target's optimizer is replayed on, each holding the table's values and
#: gradient (the largest first): the update its own math makes there is one step's.
SIBLINGS = 3


def _put(tree: Any, names: set[str], fn: Any) -> Any:
    """``tree`` with ``fn`` applied to the leaves at ``names``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if split.path_text(path) in names else x, tree)


def _fill(src: Any, like: Any) -> Any:
    """An array of ``like``'s shape and dtype holding ``src``'s entries in order (repeated
    when ``like`` is the larger)."""
    flat = jnp.ravel(src)
    reps = -(-int(np.size(like)) // int(flat.size))
    return jnp.tile(flat, reps)[:int(np.size(like))].reshape(np.shape(like)).astype(
        jnp.asarray(like).dtype)


def _siblings(params: Any, names: set[str]) -> list[str]:
    """The floating leaves other than the table's, the largest first."""
    leaves = [(int(np.size(x)), split.path_text(p))
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if split.path_text(p) not in names and np.size(x) > 0
              and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    return [name for _, name in sorted(leaves, key=lambda s: -s[0])[:SIBLINGS]]


def _one_optimizer(check: str, build: Any, form: Form, tie: Tie, t: Any, y: Any) -> Finding:
    """One step of the optimizer ``build`` makes from the parameters, and the table's part of
    it judged: the closed form for tyingspec's own AdamW; for the target's optimizer, a replay
    of its own math (see :func:`_judge_replayed`)."""
    import optax

    params = form.params
    tx = build(params)
    names = {tie.embedding, tie.head}
    own = check != "optimizer optax.adamw"
    siblings = _siblings(params, names) if own else []

    def zero(x: Any) -> Any:
        return jnp.zeros_like(x)

    @jax.jit
    def one_step(p: Any) -> tuple[Any, ...]:
        # compiled: run op by op, an optax step costs seconds of per-operation compiles
        state = tx.init(p)
        grads = jax.grad(form.loss)(p, t, y)
        updates, _ = tx.update(grads, state, p)
        # the same update with the table's gradient zeroed: what the gradient adds to it is
        # the step the table is given (a decoupled weight decay is in both)
        without, _ = tx.update(_put(grads, names, zero), state, p)
        E, g = leaf(p, tie.embedding), leaf(grads, tie.embedding)
        probes = []
        for s in siblings:
            ps = _put(p, {s}, lambda x: _fill(E, x))
            gs = _put(grads, {s}, lambda x: _fill(g, x))
            state_s = tx.init(ps)
            a, _ = tx.update(gs, state_s, ps)
            b, _ = tx.update(_put(gs, names | {s}, zero), state_s, ps)
            probes.append((leaf(a, tie.embedding) - leaf(b, tie.embedding),
                           leaf(a, s) - leaf(b, s)))
        return (state, grads, optax.apply_updates(p, updates), leaf(updates, tie.embedding),
                leaf(without, tie.embedding), probes)

    state, grads, new, update, without, probes = one_step(params)
    shape = (tie.vocab, tie.width)
    slots = _slots(state, shape)
    tables = _slots(params, shape)
    held = f"{slots} state slots of the table's shape for {tables} such leaf(s)"
    if tie.how == "two paths, one array":
        apart = float(np.abs(_f64(leaf(new, tie.embedding)) - _f64(leaf(new, tie.head))).max())
        return failed(check, _ONCE, "optimizer_sees_tie_twice",
                      f"the tree holds the table under two paths, {tie.embedding} and "
                      f"{tie.head}: jax.grad gives each its own path's gradient, the optimizer "
                      f"keeps {slots} state slots of its shape and applies one update per path "
                      f"(after one step the two paths differ by max |diff| {apart:.3g}); tie "
                      "in one leaf read by both uses")
    E0, g = _f64(leaf(params, tie.embedding)), _f64(leaf(grads, tie.embedding))
    if own:
        return _judge_replayed(check, g, _f64(update), _f64(without),
                               [(_f64(a), _f64(b)) for a, b in probes], siblings, _unit(tie),
                               held)
    lr, wd, eps = 1e-3, 0.01, 1e-8
    # step 1 of AdamW: the bias corrections cancel, m / (sqrt(v) + eps) = g / (|g| + eps)
    expected = E0 - lr * (g / (np.abs(g) + eps) + wd * E0)
    got = _f64(leaf(new, tie.embedding))
    if _close(got, expected, _unit(tie), 32):
        return passed(check, _ONCE, f"moved by exactly one update; {held}")
    step = expected - E0
    moved = float(((got - E0) * step).sum() / max(float((step * step).sum()), 1e-300))
    twice = abs(moved - 2) < 0.25
    return failed(check, _ONCE, "optimizer_sees_tie_twice" if twice else "unknown",
                  f"one step moved the table by {moved:.2f} updates" + (
                      " (not stepped)" if abs(moved) < 0.25 else
                      " (the wrong sign: up its gradient)" if moved < 0 else ""))


def _judge_replayed(check: str, g: np.ndarray, update: np.ndarray, without: np.ndarray,
                    probes: list[tuple[np.ndarray, np.ndarray]], siblings: list[str],
                    unit: float, held: str) -> Finding:
    """The table's update from the target's optimizer, judged by the optimizer's own math:

    * its gradient's part (``update - without``: the same update with the table's gradient
      zeroed) must be there (a table masked out of the optimizer, or given a zero transform,
      is never stepped) and must go down the gradient (a leaf left out of ``optax.masked``
      keeps its gradient as its update, and ``apply_updates`` adds it: an ascent step);
    * replayed with another leaf holding the table's values and gradient (``probes``: the
      table's and that leaf's gradient parts), an element-wise optimizer's update is the
      same at both: twice that leaf's is a table stepped twice; an update like none of the
      others' (another learning rate, a layer-wise rule) is said, not judged."""
    if not np.abs(g).max(initial=0.0) > 0:
        return not_applicable(check, _ONCE, "the table's gradient is zero on this batch: no "
                              "update to judge")
    step = update - without
    scale = max(float(np.abs(update).max(initial=0.0)), float(np.abs(without).max(initial=0.0)))
    if float(np.abs(step).max(initial=0.0)) <= 16 * unit * scale + 1e-300:
        return failed(check, _ONCE, "unknown",
                      f"the table is not stepped: its update (max |u| {scale:.3g}) does not "
                      f"depend on its gradient (max |g| {float(np.abs(g).max()):.3g}), as for "
                      f"a leaf masked out of the optimizer or given a zero transform; {held}")
    if float((step * g).sum()) > 0:
        passthrough = _close(update, g, unit, 4)
        return failed(check, _ONCE, "unknown",
                      "the table is stepped with the wrong sign: its update goes up its "
                      "gradient (an ascent step)" + (
                          ": the update is the gradient itself, which optax.masked leaves as "
                          "the update of a leaf its mask leaves out (apply_updates adds it)"
                          if passthrough else "") + f"; {held}")
    like: dict[str, float] = {}
    for name, (at_table, at_sibling) in zip(siblings, probes):
        n = min(at_sibling.size, at_table.size)
        a, b = at_table.reshape(-1)[:n], at_sibling.reshape(-1)[:n]
        if not np.abs(b).max(initial=0.0) > 0:
            continue  # a leaf the optimizer does not step either
        for times in (1.0, 2.0):
            if _close(a, times * b, unit, 4):
                like.setdefault(name, times)
    if 1.0 in like.values():
        name = next(k for k, v in like.items() if v == 1.0)
        return passed(check, _ONCE, f"moved down its gradient by one update: the optimizer's "
                      f"update for {name}, holding the table's values and gradient, is the "
                      f"same; {held}")
    if like:
        name = next(iter(like))
        return failed(check, _ONCE, "optimizer_sees_tie_twice",
                      f"the table is stepped twice: its update is twice the optimizer's "
                      f"update for {name} holding the table's values and gradient; {held}")
    return passed(check, _ONCE, "moved down its gradient; its update is like no other leaf's "
                  f"on the same values ({', '.join(siblings) or 'no other leaf'}: another "
                  "learning rate, or a layer-wise rule), so one update is not told from two; "
                  f"{held}")


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
            # handed a copy: a step that donates its parameters (``donate_argnums=0``)
            # deletes the buffers it is given, and the check reads them afterwards
            p, reported = step(jax.tree_util.tree_map(jnp.copy, p), t, y)
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
            if i > 0 and _close(np.asarray(float(reported)),
                                np.asarray(float(loss_at(form.params, t, y))), unit, count):
                # every leaf stale: a jitted step reading a TrainState's params it closed
                # over, not the ones it is handed; the tie (and everything) stops training
                return failed(check, _STEP, "tie_lost",
                              f"at step {i + 1} of {whose} the loss ({float(reported):.8g}) "
                              "is the loss at the parameters the step was built with, not "
                              f"the ones handed to it ({true:.8g}): the compiled step closes "
                              "over stale parameters (a TrainState's params captured when "
                              "it was traced); pass them in")
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
