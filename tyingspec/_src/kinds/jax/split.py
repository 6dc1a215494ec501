"""The two paths of a JAX loss, split at the table's own uses in its jaxpr.

A JAX model is a function of its parameters, so its tie is visible in the program itself: the
loss is traced with ``jax.make_jaxpr`` and the table's input variable is followed through it.
A use that gathers rows (``nnx.Embed.__call__``, ``jnp.take``, ``E[ids]``) is the input path;
a ``dot_general`` contracting the table's width (``.attend``, ``h @ E.T``,
``logits_via_embedding``) is the output path.  Layout-only operations between the table and
its use (a dtype conversion, a transpose, a scalar scale) are followed through in both
versions, and so is ``lax.stop_gradient``, which marks the uses below it as stopped by the
model (the reference counts them; the kind names the missing path).  A ``lax.scan`` the table
enters is unrolled and a ``lax.cond`` has every branch evaluated (the taken one selected), so
uses inside them are uses.  The tokens and targets are arguments of the trace, not
constants: one trace, and one compile of the split, serve every batch of a shape.  The
jaxpr is then evaluated by :func:`_eval` with each use reading its own copy of
the table (``E_in`` at the lookups, ``E_out`` at the heads), and ``jax.grad`` of each is the
path.

The reference never trusts the target's backward: every call-like equation (``jit``,
``custom_vjp_call``, ``custom_jvp_call``, ``checkpoint``) is inlined, so a ``custom_vjp``'s
primal is differentiated by JAX itself and its own ``bwd`` is never run here.  Zero probes
added at each lookup's output and each head's logits give ``dx`` and ``g``; ``h`` is the
head's other operand: what :func:`core.cases.kernel_paths` builds the reference from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from tyingspec._src.core.tolerance import least_precise as _least_precise
from tyingspec._src.core.tolerance import unit_of

#: Call-like primitives whose inner jaxpr is evaluated in place (never bound): the target's
#: ``custom_vjp`` backward is what a reference must not trust, and a ``jit`` boundary must not
#: hide a use.  The parameter holding the inner program, by primitive.
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "custom_vjp_call_jaxpr": "fun_jaxpr", "custom_jvp_call": "call_jaxpr",
           "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}

#: One-operand operations that change how the table is laid out or typed, not which use it
#: feeds: followed through, in both versions.
_PASS = {"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint",
         "optimization_barrier"}
#: Layout-only operations that keep a lookup's output what the lookup read.
_RESHAPE = _PASS | {"squeeze", "reshape", "expand_dims"}


@dataclass(frozen=True)
class Tied:
    """A value derived from the table by layout-only operations: the version every lookup
    reads (``inp``) and the one every head reads (``out``); ``transposed``: [d, V]."""

    inp: Any
    out: Any
    transposed: bool = False
    # the table reached this value through ``lax.stop_gradient``: a use of it is still a use
    # (the reference counts it), one whose gradient the model stops (``*_path_missing``)
    stopped: bool = False


@dataclass
class Recorder:
    """What one evaluation saw at the table's uses."""

    probes: dict[str, list[Any]] | None = None
    lookups: list[dict[str, Any]] = field(default_factory=list)
    heads: list[dict[str, Any]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # uses that are neither (by primitive)
    # the dtypes the table is converted to on its way to a use: the dtypes the model runs it in
    casts: list[str] = field(default_factory=list)
    # a slice of the table: its shape, the slice's start and its size on each axis (a
    # position table read as ``pe[:, :T]``: the context is its size on that axis)
    slices: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list)
    # id of the value each lookup returned -> its index in ``lookups`` (the values stay alive
    # in the evaluation's environment, so an id is not reused while it is read)
    read: dict[int, int] = field(default_factory=dict)


def _inner(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    key = _INLINE.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    sub = eqn.params[key]
    if isinstance(sub, jcore.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    if isinstance(sub, jcore.Jaxpr):
        return sub, ()
    return None


def _bind(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    out = eqn.primitive.bind(*ins, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rec: Recorder) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _inner(eqn)
        if sub is not None:
            outs = _eval(sub[0], sub[1], ins, rec)
        elif eqn.primitive.name in _CONTROL and any(isinstance(x, Tied) for x in ins):
            outs = _CONTROL[eqn.primitive.name](eqn, ins, rec)
        else:
            outs = _apply(eqn, ins, rec)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn: Any, ins: list[Any], rec: Recorder) -> list[Any]:
    """``lax.scan`` reading the table (a chunked cross-entropy head, a scan over layers)
    unrolled, so that each iteration's uses are uses; one that carries or scans over the
    table itself is not a use this follows (refused as another use)."""
    prm = eqn.params
    body, n_const, n_carry = prm["jaxpr"], int(prm["num_consts"]), int(prm["num_carry"])
    consts, carry, xs = ins[:n_const], ins[n_const:n_const + n_carry], ins[n_const + n_carry:]
    if any(isinstance(x, Tied) for x in carry + xs):
        return _apply(eqn, ins, rec)
    length = int(prm["length"])
    ys: list[list[Any]] = []
    for i in (reversed(range(length)) if prm["reverse"] else range(length)):
        outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)], rec)
        outs = _untied(outs, "scan", rec)
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if prm["reverse"]:
        ys.reverse()
    stacked = [jnp.stack([y[k] for y in ys]) if ys else
               jnp.zeros((0, *v.aval.shape), v.aval.dtype)
               for k, v in enumerate(eqn.outvars[n_carry:])]
    return [*carry, *stacked]


def _cond(eqn: Any, ins: list[Any], rec: Recorder) -> list[Any]:
    """``lax.cond``/``switch`` reading the table: every branch evaluated, the taken one's
    values selected (a use in a branch not taken gets zero cotangents: no gradient)."""
    index, ops = ins[0], ins[1:]
    branches = [_untied(_eval(b.jaxpr, b.consts, ops, rec), "cond", rec)
                for b in eqn.params["branches"]]
    if len(branches) == 1:
        return branches[0]
    return [jax.lax.select_n(index, *outs) for outs in zip(*branches)]


def _untied(outs: list[Any], name: str, rec: Recorder) -> list[Any]:
    """Outputs of a control-flow body; one that hands the table itself on is not a use the
    split follows: refused (recorded as another use), evaluation going on with the head's
    version, as :func:`_apply` does."""
    if any(isinstance(o, Tied) for o in outs):
        rec.other.append(f"{name} returning the table")
    return [o.out if isinstance(o, Tied) else o for o in outs]


#: Control flow evaluated here (not bound) when the table enters it.
_CONTROL: dict[str, Callable[[Any, list[Any], Recorder], list[Any]]] = {
    "scan": _scan, "cond": _cond}


def _row_gather(params: dict[str, Any], width: int) -> bool:
    """A gather of whole rows: indices of the row alone (``E[ids]``, ``jnp.take``), or of the
    row and a column start, the slice as wide as the table (``weight[i]`` under ``jax.vmap``,
    as equinox's ``jax.vmap(embedding)`` lowers; the start can only be 0)."""
    dn = params["dimension_numbers"]
    if tuple(params["slice_sizes"]) != (1, width) or \
            tuple(getattr(dn, "operand_batching_dims", ())):
        return False
    rows_only = tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
    return rows_only or _row_and_column(params)


def _row_and_column(params: dict[str, Any]) -> bool:
    dn = params["dimension_numbers"]
    return tuple(dn.start_index_map) == (0, 1) and not tuple(dn.collapsed_slice_dims) and \
        params["mode"] != jax.lax.GatherScatterMode.FILL_OR_DROP


def _apply(eqn: Any, ins: list[Any], rec: Recorder) -> list[Any]:
    tied = [i for i, x in enumerate(ins) if isinstance(x, Tied)]
    if not tied and eqn.primitive.name == "stop_gradient" and id(ins[0]) in rec.read:
        # on what a lookup read (`stop_gradient(E[t])`, torch's `.detach()` of it), as on the
        # table itself: followed through unstopped, so that the reference is the gradient of
        # every use, and that lookup is marked as stopped by the model.  Stops elsewhere (the
        # stopped max of a logsumexp) are the model's own arithmetic and stay.
        rec.lookups[rec.read[id(ins[0])]]["stopped"] = True
        return list(ins)
    if not tied:
        outs = _bind(eqn, ins)
        if eqn.primitive.name in _RESHAPE and id(ins[0]) in rec.read:
            # still what the lookup read: equinox's per-token ``weight[i]`` under ``jax.vmap``
            # gathers [.., 1, d] and squeezes it before a ``stop_gradient`` of its output
            rec.read[id(outs[0])] = rec.read[id(ins[0])]
        return outs
    name = eqn.primitive.name

    def both(k: int, fn: Callable[[Any], list[Any]], transposed: bool) -> list[Any]:
        t = ins[k]
        return [Tied(a, b, transposed, t.stopped) for a, b in zip(fn(t.inp), fn(t.out))]

    def with_(k: int, value: Any) -> list[Any]:
        args = list(ins)
        args[k] = value
        return _bind(eqn, args)

    if len(tied) == 1:
        k = tied[0]
        t: Tied = ins[k]
        if name == "stop_gradient":
            # followed through unstopped: the reference is the gradient of every use, and
            # the uses below it are marked as stopped by the model
            return [Tied(t.inp, t.out, t.transposed, True)]
        if name in _PASS and len(ins) == 1:
            if name == "convert_element_type":
                rec.casts.append(str(jnp.dtype(eqn.params["new_dtype"])))
            return both(k, lambda v: with_(k, v), t.transposed)
        if name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
            return both(k, lambda v: with_(k, v), not t.transposed)
        if name in ("mul", "div") and (name == "mul" or k == 0) and \
                int(np.size(ins[1 - k])) == 1:
            return both(k, lambda v: with_(k, v), t.transposed)
        two_d = np.ndim(t.inp) == 2
        if name == "gather" and k == 0 and two_d and not t.transposed and \
                _row_gather(eqn.params, int(np.shape(t.inp)[1])):
            return [_lookup(eqn, ins, t, rec)]
        if name == "dot_general" and two_d:
            out = _head(eqn, ins, k, t, rec)
            if out is not None:
                return [out]
        _sliced(eqn, ins, k, rec)
    rec.other.append(name)
    # evaluation goes on with the head's version: the observation is refused for this use
    return _bind(eqn, [x.out if isinstance(x, Tied) else x for x in ins])


def _sliced(eqn: Any, ins: list[Any], k: int, rec: Recorder) -> None:
    """Record a static or dynamic slice of the table (``k == 0``): its shape, where it
    starts and how much it keeps on each axis (a start that is not known is -1)."""
    if k != 0 or eqn.primitive.name not in ("slice", "dynamic_slice"):
        return
    shape = tuple(int(n) for n in np.shape(ins[0].inp))
    if eqn.primitive.name == "slice":
        starts = tuple(int(a) for a in eqn.params["start_indices"])
        sizes = tuple(int(b) - int(a) for a, b in zip(eqn.params["start_indices"],
                                                       eqn.params["limit_indices"]))
    else:
        starts = tuple(int(i) if not isinstance(i, jax.core.Tracer) and np.ndim(i) == 0
                       else -1 for i in ins[1:])
        sizes = tuple(int(n) for n in eqn.params["slice_sizes"])
    rec.slices.append((shape, starts, sizes))


def _lookup(eqn: Any, ins: list[Any], t: Tied, rec: Recorder) -> Any:
    out = _bind(eqn, [t.inp, *ins[1:]])[0]
    k = len(rec.lookups)
    ids = ins[1][..., :1] if _row_and_column(eqn.params) else ins[1]
    rec.lookups.append({"ids": ids, "shape": tuple(np.shape(out)), "dtype": out.dtype,
                        "stopped": t.stopped})
    if rec.probes is not None:
        out = out + rec.probes["x"][k]
    rec.read[id(out)] = k
    return out


def _head(eqn: Any, ins: list[Any], k: int, t: Tied, rec: Recorder) -> Any | None:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    tc, hc = (lc, rc)[k], (lc, rc)[1 - k]
    d_axis = 0 if t.transposed else 1
    if lb or rb or len(tc) != 1 or len(hc) != 1 or int(tc[0]) != d_axis:
        return None
    args = list(ins)
    args[k] = t.out
    out = _bind(eqn, args)[0]
    j = len(rec.heads)
    rec.heads.append({"h": ins[1 - k], "hc": int(hc[0]), "side": k,
                      "shape": tuple(np.shape(out)), "dtype": out.dtype,
                      "stopped": t.stopped})
    if rec.probes is not None:
        out = out + rec.probes["g"][j]
    return out


@dataclass(frozen=True)
class Traced:
    """A loss traced once: its jaxpr over the flattened parameter leaves, then the tokens and
    the targets (arguments, not constants: one trace and one compile serve every batch of
    its shape); ``batch``: the tokens and targets it was traced with (what a survey reads
    lookup indices from)."""

    jaxpr: Any  # ClosedJaxpr
    leaves: list[Any]
    paths: list[str]
    treedef: Any
    batch: tuple[Any, Any]
    # compiled observations, per uses and batch shape, each with the Recorders its trace filled
    observers: dict[tuple[Any, ...], tuple[Any, Recorder, Recorder]] = field(
        default_factory=dict, compare=False, repr=False)

    def run(self, args: Sequence[Any], rec: Recorder, batch: Sequence[Any] = ()) -> Any:
        """The loss at ``args`` (the leaves, some :class:`Tied`) on ``batch`` (the traced
        one by default)."""
        return _eval(self.jaxpr.jaxpr, self.jaxpr.consts, [*args, *(batch or self.batch)],
                     rec)[0]


def path_text(path: Sequence[Any]) -> str:
    parts = []
    for p in path:
        key = getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))
        parts.append(str(key))
    if len(parts) > 1 and parts[-1] == "value":  # an NNX Variable's own leaf
        parts.pop()
    return "/".join(parts)


def trace(loss: Callable[..., Any], params: Any, tokens: Any, targets: Any) -> Traced:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in with_paths]

    def flat(*xs: Any) -> Any:
        *ps, t, y = xs
        return loss(jax.tree_util.tree_unflatten(treedef, ps), t, y)

    batch = (jnp.asarray(tokens), jnp.asarray(targets))
    closed = jax.make_jaxpr(flat)(*leaves, *batch)
    return Traced(closed, leaves, [path_text(p) for p, _ in with_paths], treedef, batch)


@dataclass(frozen=True)
class Survey:
    lookups: int
    heads: int
    other: tuple[str, ...]
    casts: tuple[str, ...] = ()  # dtypes it is converted to on its way to a use
    # rows read by position (a lookup whose indices are 0, 1, ... along the sequence, known
    # without the parameters: a position table), and the slices taken of it
    by_position: bool = False
    slices: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


def _positions(ids: Any) -> bool:
    """Whether lookup indices are known values counting 0, 1, ... along their last axis (a
    position table read with ``arange(T)``), not tokens."""
    if isinstance(ids, jax.core.Tracer):
        return False
    a = np.asarray(ids)
    if a.ndim >= 2 and a.shape[-1] == 1:  # a gather's index vector dimension
        a = a[..., 0]
    return a.ndim >= 1 and a.shape[-1] > 1 and bool(np.all(a == np.arange(a.shape[-1])))


def survey(tr: Traced, i: int, transposed: bool = False) -> Survey:
    """How leaf ``i`` is used (abstractly evaluated: no arithmetic on the parameters or the
    batch runs; what depends on neither is computed, so position indices are known values);
    ``transposed``: the leaf read as ``[d, V]`` (a ``Dense(d, V)`` kernel as a head)."""
    rec = Recorder()
    n = len(tr.leaves)

    def run(*xs: Any) -> Any:
        args = list(xs[:n])
        args[i] = Tied(xs[i], xs[i], transposed)
        return tr.run(args, rec, xs[n:])

    # the batch abstract too: indices the model computes without it (a position table's
    # ``arange(T)``) are known values, and those it reads from the tokens are not computed (the
    # tokens' arithmetic, run eagerly, compiled a program per operation and batch shape)
    with jax.ensure_compile_time_eval():
        jax.eval_shape(run, *tr.leaves, *tr.batch)
    return Survey(len(rec.lookups), len(rec.heads), tuple(rec.other), tuple(rec.casts),
                  any(_positions(u["ids"]) for u in rec.lookups), tuple(rec.slices))


@dataclass(frozen=True)
class Observed:
    """The split evaluation: the loss, each path as JAX differentiates the primal, and the
    ids, dx, h and g recorded at the uses (float64 numpy); ``problem`` when a use could not
    be observed (the paths are still JAX's own split)."""

    loss: float
    dE_in: np.ndarray
    dE_out: np.ndarray
    ids: np.ndarray
    dx: np.ndarray
    h: np.ndarray
    g: np.ndarray
    lookups: int
    heads: int
    problem: str | None
    # the least precise dtype a head's logits are computed in: what the output path's
    # contraction over the batch rounds at
    logits_dtype: str = "float64"
    # whether some lookup (head) reaches the table without ``lax.stop_gradient``: the model's
    # own gradient has that path at all
    input_reached: bool = True
    output_reached: bool = True


def head_transposed(tr: Traced, lookup: int, head: int) -> bool:
    """Whether the head's leaf holds the table as ``[d, V]`` (a ``Dense(d, V)`` kernel beside a
    ``[V, d]`` lookup table): it is handed ``E_out.T``."""
    a, b = np.shape(tr.leaves[lookup]), np.shape(tr.leaves[head])
    return lookup != head and len(a) == 2 and a[0] != a[1] and tuple(b) == tuple(a[::-1])


def _args(tr: Traced, lookup: int, head: int, E_in: Any, E_out: Any) -> list[Any]:
    args = list(tr.leaves)
    if lookup == head:
        args[lookup] = Tied(E_in, E_out)
    elif head_transposed(tr, lookup, head):
        args[lookup] = Tied(E_in, E_in)
        args[head] = Tied(E_out.T, E_out.T, True)
    else:
        args[lookup] = Tied(E_in, E_in)
        args[head] = Tied(E_out, E_out)
    return args


def split_loss(tr: Traced, lookup: int, head: int) -> Callable[[Any, Any], Any]:
    """The loss with the lookups reading the first argument and the heads the second."""
    def fn(E_in: Any, E_out: Any) -> Any:
        rec = Recorder()
        return tr.run(_args(tr, lookup, head, E_in, E_out), rec)
    return fn


def _observer(tr: Traced, lookup: int, head: int, E_in: Any, E_out: Any, t: Any, y: Any
              ) -> tuple[Any, Recorder, Recorder]:
    """The compiled split evaluation of ``observe`` and the two Recorders its traces fill:
    ``shapes`` (the uses' shapes, for the probes) and ``rec`` (what each use is: a compiled
    call runs no Python, so what its trace recorded stands for every call of that shape)."""
    shapes = Recorder()

    def shaped(a: Any, b: Any, tt: Any, yy: Any) -> Any:
        return tr.run(_args(tr, lookup, head, a, b), shapes, (tt, yy))

    jax.eval_shape(shaped, E_in, E_out, t, y)
    rec = Recorder({"x": [], "g": []})

    def run(a: Any, b: Any, p: dict[str, list[Any]], tt: Any, yy: Any) -> tuple[Any, Any]:
        rec.probes = p  # the traced probes: their gradients are dx and g
        rec.lookups.clear()
        rec.heads.clear()
        rec.other.clear()
        out = tr.run(_args(tr, lookup, head, a, b), rec, (tt, yy))
        return out, ([u["h"] for u in rec.heads], [u["ids"] for u in rec.lookups])

    # compiled once: evaluated op by op, a small model's split costs seconds on 2 cores
    fn = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))
    return fn, shapes, rec


def observe(tr: Traced, lookup: int, head: int, batch: Sequence[Any] = ()) -> Observed:
    """Both paths of leaf ``lookup`` (read by the lookups) and ``head`` (by the heads), on
    ``batch`` (tokens, targets; default: the one traced).  Compiled once per ``tr``, uses and
    batch shape: the tokens and targets are the compiled function's arguments."""
    t, y = batch or tr.batch
    E_in, E_out = tr.leaves[lookup], tr.leaves[head]
    if head_transposed(tr, lookup, head):
        E_out = E_out.T  # the [V, d] table the head's [d, V] kernel holds
    key = (lookup, head, tuple(np.shape(t)), tuple(np.shape(y)))
    if key not in tr.observers:
        tr.observers[key] = _observer(tr, lookup, head, E_in, E_out, t, y)
    fn, shapes, rec = tr.observers[key]
    # numpy's zeros: JAX's compile a broadcast per shape
    probes = {"x": [np.zeros(u["shape"], u["dtype"]) for u in shapes.lookups],
              "g": [np.zeros(u["shape"], u["dtype"]) for u in shapes.heads]}
    (loss, (hs, idss)), (g_in, g_out, g_probe) = fn(E_in, E_out, probes, t, y)
    V, d = np.shape(E_in)
    problem = None
    if rec.other:
        problem = (f"the table also feeds {', '.join(sorted(set(rec.other)))}, which is "
                   "neither a row lookup nor a head")
    elif not rec.lookups or not rec.heads:
        problem = "the split found no lookup or no head"
    ids = np.concatenate([np.asarray(i).reshape(-1) for i in idss]
                         or [np.zeros(0, np.int64)]).astype(np.int64)
    dx = np.concatenate([f64(x).reshape(-1, d) for x in g_probe["x"]] or
                        [np.zeros((0, d))])
    hh, gg = [], []
    for u, h, g in zip(rec.heads, hs, g_probe["g"]):
        hh.append(np.moveaxis(f64(h), u["hc"], -1).reshape(-1, d))
        gv = f64(g)
        gg.append((gv if u["side"] == 1 else np.moveaxis(gv, 0, -1)).reshape(-1, V))
    h_all = np.concatenate(hh) if hh else np.zeros((0, d))
    g_all = np.concatenate(gg) if gg else np.zeros((0, V))
    dE_in, dE_out = f64(g_in), f64(g_out)
    if problem is None and ids.size != dx.shape[0]:
        problem = "the lookups' indices and outputs do not pair up row by row"
    if problem is None:
        # the recorded uses must account for JAX's own split (a head layout misread, a use
        # seen twice): checked before anything is built on them
        scale = float(np.abs(dE_out).max(initial=0.0)) + float(np.abs(dE_in).max(initial=0.0))
        tol = 128 * unit_of(jnp.asarray(E_in).dtype) * max(ids.size, 1) * (scale + 1e-300)
        rebuilt_in = np.zeros((V, d))
        np.add.at(rebuilt_in, ids, dx)
        if np.abs(g_all.T @ h_all - dE_out).max(initial=0.0) > tol or \
                np.abs(rebuilt_in - dE_in).max(initial=0.0) > tol:
            problem = "the recorded dx, h and g do not rebuild JAX's own split of the paths"
    logits = least_precise_of(u["dtype"] for u in shapes.heads)
    return Observed(float(loss), dE_in, dE_out, ids, dx, h_all, g_all, len(rec.lookups),
                    len(rec.heads), problem, logits,
                    input_reached=not rec.lookups or any(not u["stopped"] for u in rec.lookups),
                    output_reached=not rec.heads or any(not u["stopped"] for u in rec.heads))


def least_precise_of(dtypes: Iterable[Any]) -> str:
    """The least precise of ``dtypes`` (float64 when none), by core's roundoff."""
    return _least_precise(*(jnp.dtype(d) for d in dtypes))


def least_precise(tr: Traced) -> str:
    """The least precise floating dtype any equation of the loss computes in (a float32
    ``nnx.Embed`` keeps float32 under float64 parameters): what its rounding really is."""
    found: list[Any] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                dt = getattr(v.aval, "dtype", None)
                if dt is not None and jnp.issubdtype(dt, jnp.floating):
                    found.append(dt)
            sub = _inner(eqn)
            if sub is not None:
                walk(sub[0])

    walk(tr.jaxpr.jaxpr)
    return least_precise_of(found)


def f64(x: Any) -> np.ndarray:
    """``x`` as a float64 numpy copy, converted by numpy (exact from bfloat16, which numpy
    holds as ml_dtypes' type): a conversion by JAX compiles a program per shape and dtype,
    twenty of them a check."""
    return np.asarray(x).astype(np.float64)
