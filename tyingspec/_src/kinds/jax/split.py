"""The two paths of a JAX loss, split at the table's own uses in its jaxpr.

A JAX model is a function of its parameters, so its tie is visible in the program itself: the
loss is traced with ``jax.make_jaxpr`` and the table's input variable is followed through it.
A use that gathers rows (``nnx.Embed.__call__``, ``jnp.take``, ``E[ids]``) is the input path;
a ``dot_general`` contracting the table's width (``.attend``, ``h @ E.T``,
``logits_via_embedding``) is the output path.  Layout-only operations between the table and
its use (a dtype conversion, a transpose, a scalar scale) are followed through in both
versions.  The jaxpr is then evaluated by :func:`_eval` with each use reading its own copy of
the table (``E_in`` at the lookups, ``E_out`` at the heads), and ``jax.grad`` of each is the
path.

The reference never trusts the target's backward: every call-like equation (``jit``,
``custom_vjp_call``, ``custom_jvp_call``, ``checkpoint``) is inlined, so a ``custom_vjp``'s
primal is differentiated by JAX itself and its own ``bwd`` is never run here.  Zero probes
added at each lookup's output and each head's logits give ``dx`` and ``g``; ``h`` is the
head's other operand: what :func:`core.cases.kernel_paths` builds the reference from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

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


@dataclass(frozen=True)
class Tied:
    """A value derived from the table by layout-only operations: the version every lookup
    reads (``inp``) and the one every head reads (``out``); ``transposed``: [d, V]."""

    inp: Any
    out: Any
    transposed: bool = False


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
        outs = _eval(sub[0], sub[1], ins, rec) if sub is not None else _apply(eqn, ins, rec)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _row_gather(params: dict[str, Any], width: int) -> bool:
    dn = params["dimension_numbers"]
    return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
            and tuple(params["slice_sizes"]) == (1, width)
            and not tuple(getattr(dn, "operand_batching_dims", ())))


def _apply(eqn: Any, ins: list[Any], rec: Recorder) -> list[Any]:
    tied = [i for i, x in enumerate(ins) if isinstance(x, Tied)]
    if not tied:
        return _bind(eqn, ins)
    name = eqn.primitive.name

    def both(k: int, fn: Callable[[Any], list[Any]], transposed: bool) -> list[Any]:
        t = ins[k]
        return [Tied(a, b, transposed) for a, b in zip(fn(t.inp), fn(t.out))]

    def with_(k: int, value: Any) -> list[Any]:
        args = list(ins)
        args[k] = value
        return _bind(eqn, args)

    if len(tied) == 1:
        k = tied[0]
        t: Tied = ins[k]
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
    rec.lookups.append({"ids": ins[1], "shape": tuple(np.shape(out)), "dtype": out.dtype})
    if rec.probes is not None:
        out = out + rec.probes["x"][k]
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
                      "shape": tuple(np.shape(out)), "dtype": out.dtype})
    if rec.probes is not None:
        out = out + rec.probes["g"][j]
    return out


@dataclass(frozen=True)
class Traced:
    """A loss traced once: its jaxpr over the flattened parameter leaves."""

    jaxpr: Any  # ClosedJaxpr
    leaves: list[Any]
    paths: list[str]
    treedef: Any


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
        return loss(jax.tree_util.tree_unflatten(treedef, list(xs)), tokens, targets)

    closed = jax.make_jaxpr(flat)(*leaves)
    return Traced(closed, leaves, [path_text(p) for p, _ in with_paths], treedef)


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


def survey(tr: Traced, i: int) -> Survey:
    """How leaf ``i`` is used (abstractly evaluated: no arithmetic on the parameters runs;
    what depends on the batch alone is computed, so lookup indices are known values)."""
    rec = Recorder()

    def run(*xs: Any) -> Any:
        args = list(xs)
        args[i] = Tied(xs[i], xs[i])
        return _eval(tr.jaxpr.jaxpr, tr.jaxpr.consts, args, rec)[0]

    with jax.ensure_compile_time_eval():
        jax.eval_shape(run, *tr.leaves)
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


def _args(tr: Traced, lookup: int, head: int, E_in: Any, E_out: Any) -> list[Any]:
    args = list(tr.leaves)
    if lookup == head:
        args[lookup] = Tied(E_in, E_out)
    else:
        args[lookup] = Tied(E_in, E_in)
        args[head] = Tied(E_out, E_out)
    return args


def split_loss(tr: Traced, lookup: int, head: int) -> Callable[[Any, Any], Any]:
    """The loss with the lookups reading the first argument and the heads the second."""
    def fn(E_in: Any, E_out: Any) -> Any:
        rec = Recorder()
        return _eval(tr.jaxpr.jaxpr, tr.jaxpr.consts, _args(tr, lookup, head, E_in, E_out),
                     rec)[0]
    return fn


def observe(tr: Traced, lookup: int, head: int) -> Observed:
    """Both paths of leaf ``lookup`` (read by the lookups) and ``head`` (by the heads)."""
    E_in, E_out = tr.leaves[lookup], tr.leaves[head]
    shapes = Recorder()

    def shaped(a: Any, b: Any) -> Any:
        return _eval(tr.jaxpr.jaxpr, tr.jaxpr.consts, _args(tr, lookup, head, a, b), shapes)[0]

    jax.eval_shape(shaped, E_in, E_out)
    probes = {"x": [jnp.zeros(u["shape"], u["dtype"]) for u in shapes.lookups],
              "g": [jnp.zeros(u["shape"], u["dtype"]) for u in shapes.heads]}
    rec = Recorder(probes)

    def run(a: Any, b: Any, p: dict[str, list[Any]]) -> tuple[Any, Any]:
        rec.probes = p  # the traced probes: their gradients are dx and g
        rec.lookups.clear()
        rec.heads.clear()
        rec.other.clear()
        out = _eval(tr.jaxpr.jaxpr, tr.jaxpr.consts, _args(tr, lookup, head, a, b), rec)[0]
        return out, ([u["h"] for u in rec.heads], [u["ids"] for u in rec.lookups])

    # compiled once: evaluated op by op, a small model's split costs seconds on 2 cores
    (loss, (hs, idss)), (g_in, g_out, g_probe) = jax.jit(jax.value_and_grad(
        run, argnums=(0, 1, 2), has_aux=True))(E_in, E_out, probes)
    V, d = np.shape(E_in)
    problem = None
    if rec.other:
        problem = (f"the table also feeds {', '.join(sorted(set(rec.other)))}, which is "
                   "neither a row lookup nor a head")
    elif not rec.lookups or not rec.heads:
        problem = "the split found no lookup or no head"
    ids = np.concatenate([np.asarray(i).reshape(-1) for i in idss]
                         or [np.zeros(0, np.int64)]).astype(np.int64)
    dx = np.concatenate([_f64(x).reshape(-1, d) for x in g_probe["x"]] or
                        [np.zeros((0, d))])
    hh, gg = [], []
    for u, h, g in zip(rec.heads, hs, g_probe["g"]):
        hh.append(np.moveaxis(_f64(h), u["hc"], -1).reshape(-1, d))
        gv = _f64(g)
        gg.append((gv if u["side"] == 1 else np.moveaxis(gv, 0, -1)).reshape(-1, V))
    h_all = np.concatenate(hh) if hh else np.zeros((0, d))
    g_all = np.concatenate(gg) if gg else np.zeros((0, V))
    dE_in, dE_out = _f64(g_in), _f64(g_out)
    if problem is None and ids.size != dx.shape[0]:
        problem = "the lookups' indices and outputs do not pair up row by row"
    if problem is None:
        # the recorded uses must account for JAX's own split (a head layout misread, a use
        # seen twice): checked before anything is built on them
        scale = float(np.abs(dE_out).max(initial=0.0)) + float(np.abs(dE_in).max(initial=0.0))
        unit = float(np.finfo(jnp.asarray(E_in).dtype).eps)
        tol = 64 * unit * max(ids.size, 1) * (scale + 1e-300)
        rebuilt_in = np.zeros((V, d))
        np.add.at(rebuilt_in, ids, dx)
        if np.abs(g_all.T @ h_all - dE_out).max(initial=0.0) > tol or \
                np.abs(rebuilt_in - dE_in).max(initial=0.0) > tol:
            problem = "the recorded dx, h and g do not rebuild JAX's own split of the paths"
    logits = max((jnp.dtype(u["dtype"]) for u in shapes.heads),
                 key=lambda dt: float(np.finfo(dt).eps), default=jnp.dtype(jnp.float64))
    return Observed(float(loss), dE_in, dE_out, ids, dx, h_all, g_all, len(rec.lookups),
                    len(rec.heads), problem, str(logits))


def least_precise(tr: Traced) -> Any:
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
    return max(found, key=lambda dt: float(np.finfo(dt).eps), default=jnp.float64)


def _f64(x: Any) -> np.ndarray:
    # float64 is enabled in the worker (see kinds.jax.adapter), so this is exact from bfloat16
    return np.asarray(jnp.asarray(x).astype(jnp.float64), dtype=np.float64).copy()
