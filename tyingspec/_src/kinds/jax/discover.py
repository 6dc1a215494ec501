"""A JAX target as tyingspec sees it: a pure loss of a parameter tree, and where its tie is.

Runs where the user's code runs (the worker process); imports jax and flax (and equinox for an
equinox model).  Every form (an NNX module, a Linen module with its variables, an equinox
module, a pure ``loss_fn``) becomes one pure function ``loss(params, tokens, targets)`` of one
tree, so the checks, the split and the reference treat them all alike.  Discovery never edits
the model it inspects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.target import JaxTarget

#: The invariant the discovery check guards.
ONE_LEAF = "the lookup and the head read one leaf of the parameter tree"

_DTYPES = {"float64": jnp.float64, "float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}

Loss = Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class Form:
    """A target as one pure loss of one parameter tree."""

    kind: str  # "nnx" | "linen" | "haiku" | "equinox" | "function"
    params: Any
    loss: Loss
    target: JaxTarget
    # params -> params after a trip into a fresh model and out (NNX: nnx.update + split);
    # the identity of a pure tree is its own
    reload: Callable[[Any], Any]
    # the module whose attributes declare its configuration (NNX or Linen); None: a function
    model: Any = None


@dataclass(frozen=True)
class Tie:
    """Where the tied table is read, and the batch it was traced with (described: the largest
    batch a check runs, see :mod:`kinds.jax.shape`)."""

    embedding: str  # path of the leaf the lookups read
    head: str  # path of the leaf the heads read (the same for a real tie)
    vocab: int
    width: int
    batch_size: int
    seq_len: int
    form: str
    how: str  # "one leaf" | "two paths, one array" | "copy" (equal values, two arrays)
    padding_idx: None = None  # JAX lookups have none; the engine reads the key
    dtype: str = "float32"


def as_target(spec: str, obj: Any) -> JaxTarget:
    """A resolved attribute as a :class:`JaxTarget`: a target, or a zero-argument factory of
    an NNX module (or of a target)."""
    if isinstance(obj, JaxTarget):
        return obj
    if callable(obj):
        try:
            made = obj()
        except Exception as exc:
            raise AdapterError(spec, "the target factory raised",
                               got=f"{type(exc).__name__}: {exc}") from exc
        if isinstance(made, JaxTarget):
            return made
        return JaxTarget(model=lambda: obj())
    raise AdapterError(spec, "is neither a model factory nor a JaxTarget",
                       expected="a zero-argument callable returning a flax.nnx.Module, or a "
                                "tyingspec.JaxTarget", got=type(obj).__name__)


def mean_ce(logits: Any, targets: Any) -> Any:
    """The mean token cross-entropy of logits [..., V] against integer targets [...]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


#: Names a model's second argument has when it is the targets (nanoGPT's ``targets``).
_TARGET_NAMES = ("targets", "target", "labels", "label", "y")


def _takes_targets(fn: Any) -> bool:
    """Whether a model's ``__call__(self, inputs, ...)`` takes the targets second: a second
    positional argument without a default, or one named like targets.  lm1b's
    ``TransformerLM(inputs, inputs_positions=None, ...)`` takes the tokens alone, and its
    loss is computed from its logits, as the torch kind does."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    except (TypeError, ValueError):
        return False
    if len(params) < 2:
        return False
    second = params[1]
    return second.default is inspect.Parameter.empty or second.name in _TARGET_NAMES


def _scalar(out: Any, targets: Any, takes_targets: bool) -> Any:
    if not isinstance(out, tuple) and hasattr(out, "logits"):
        # an output dataclass (DeepMind gemma's ``Output``, a transformers ``ModelOutput``)
        out = out.logits
    if isinstance(out, tuple):
        # (logits, loss) as nanoGPT-style models return with targets, (logits, cache) without
        out = out[-1] if takes_targets else out[0]
    if np.ndim(out) >= 1 and tuple(np.shape(out)[:-1]) == tuple(np.shape(targets)):
        return mean_ce(out, targets)  # logits, whatever else it takes
    return out


def cast(params: Any, dtype: Any) -> Any:
    """Every floating leaf of ``params`` in ``dtype`` (integer leaves kept)."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
        else x, params)


def build_form(spec: str, target: JaxTarget, precision: str = "auto") -> Form:
    """The target as a :class:`Form`, in ``precision`` when one is declared."""
    from flax import nnx

    chosen = [k for k in ("model", "module", "loss_fn") if getattr(target, k) is not None]
    if len(chosen) != 1:
        raise AdapterError(spec, "a JaxTarget takes exactly one of model, module, loss_fn",
                           expected="one form", got=", ".join(chosen) or "none")
    want = _DTYPES.get(precision)
    if target.model is not None:
        try:
            model = target.model()
        except Exception as exc:
            raise AdapterError(spec, "the model factory raised",
                               got=f"{type(exc).__name__}: {exc}") from exc
        if is_equinox(model):
            return _equinox_form(target, model, want)
        if not isinstance(model, nnx.Module):
            raise AdapterError(spec, "the model factory returned something else",
                               expected="a flax.nnx.Module or an equinox.Module (a Linen "
                                        "module needs JaxTarget(module=..., params=...))",
                               got=type(model).__name__)
        parts: Any = nnx.split(model, nnx.Param, ...)
        graphdef, params, rest = parts
        takes = _takes_targets(type(model).__call__)

        def nnx_loss(p: Any, t: Any, y: Any) -> Any:
            m = nnx.merge(graphdef, p, rest)
            return _scalar(m(t, y) if takes else m(t), y, takes)

        def reload(p: Any) -> Any:
            fresh = target.model() if target.model is not None else None
            nnx.update(fresh, p)
            return nnx.split(fresh, nnx.Param, ...)[1]

        if want is not None:
            params = cast(params, want)
        return Form("nnx", params, nnx_loss, target, reload, model)
    params = target.params() if callable(target.params) and not is_equinox(target.params) \
        else target.params
    if params is None:
        raise AdapterError(spec, "the target has no parameters", key="params",
                           expected="JaxTarget(params=...) with the tree (or its factory)",
                           got="None")
    if want is not None:
        params = cast(params, want)
    if target.module is not None:
        module = target.module
        takes = _takes_targets(type(module).__call__)

        def linen_loss(p: Any, t: Any, y: Any) -> Any:
            out = module.apply(p, t, y) if takes else module.apply(p, t)
            return _scalar(out, y, takes)

        # haiku's ``hk.transform`` pair is applied as a Linen module is; named for what it is
        named = "haiku" if type(module).__module__.split(".")[0] == "haiku" else "linen"
        return Form(named, params, linen_loss, target, lambda p: p, module)
    assert target.loss_fn is not None
    if is_equinox(params):
        # an equinox module as the tree: its arrays are the parameters, the rest static
        import equinox as eqx

        arrays, static = eqx.partition(params, eqx.is_inexact_array)
        fn = target.loss_fn

        def eqx_loss(p: Any, t: Any, y: Any) -> Any:
            return fn(eqx.combine(p, static), t, y)

        return Form("function", cast(arrays, want) if want is not None else arrays, eqx_loss,
                    target, lambda p: p)
    return Form("function", params, target.loss_fn, target, lambda p: p)


def is_equinox(obj: Any) -> bool:
    """Whether ``obj`` is an ``equinox.Module`` (told without importing equinox: a module
    instance is only made by a process that imported it)."""
    return any(c.__module__.split(".")[0] == "equinox" for c in type(obj).__mro__[1:]) or \
        type(obj).__module__.split(".")[0] == "equinox"


def _equinox_form(target: JaxTarget, model: Any, want: Any) -> Form:
    """An ``equinox.Module``: its inexact arrays are the parameters (``eqx.partition``).  An
    equinox model is written for one sequence and ``jax.vmap``-ed over the batch, as
    equinox's own examples do; one that takes the batch whole is called on it."""
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)
    takes = _takes_targets(type(model).__call__)

    def call(m: Any, t: Any, y: Any) -> Any:
        def one(tt: Any, yy: Any) -> Any:
            return m(tt, yy) if takes else m(tt)
        try:
            shape = jax.eval_shape(one, t[0], y[0])
            per_sequence = not isinstance(shape, tuple) and \
                tuple(shape.shape[:-1]) == tuple(np.shape(t)[1:])
        except Exception:  # noqa: BLE001  (a model that takes the batch whole)
            per_sequence = False
        return jax.vmap(one)(t, y) if per_sequence else one(t, y)

    def eqx_loss(p: Any, t: Any, y: Any) -> Any:
        return _scalar(call(eqx.combine(p, static), t, y), y, takes)

    def reload(p: Any) -> Any:
        return p

    if want is not None:
        params = cast(params, want)
    return Form("equinox", params, eqx_loss, target, reload, model)


def leaf(tree: Any, path: str) -> Any:
    """The leaf of ``tree`` at ``path`` (keys joined by ``/``)."""
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if split.path_text(p) == path:
            return x
    raise KeyError(path)


#: The batch a target is first traced with (B, T), where it fixes neither.
PLACEHOLDER = (2, 8)


def placeholder(B: int, T: int, V: int) -> tuple[Any, Any]:
    """A placeholder batch of ``B`` x ``T`` tokens (what a loss is traced or costed with)."""
    t = jnp.asarray(np.arange(B * T).reshape(B, T) % V)
    return t, jnp.roll(t, -1, axis=-1)


def batch(target: JaxTarget, V: int) -> tuple[Any, Any]:
    """A placeholder batch of the target's shape: what the loss is first traced with."""
    return placeholder(target.batch_size or PLACEHOLDER[0], target.seq_len or PLACEHOLDER[1],
                       V)


def _vocab_guess(params: Any) -> int:
    shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(params) if np.ndim(x) == 2]
    return max((s[0] for s in shapes), default=1)


def _as_table(tr: split.Traced, lookup: int, head: int) -> np.ndarray:
    """The head leaf as the ``[V, d]`` table it holds (a ``[d, V]`` kernel transposed)."""
    x = np.asarray(tr.leaves[head])
    return x.T if split.head_transposed(tr, lookup, head) else x


def _transposed_copies(tr: split.Traced, lookups: list[int]) -> list[tuple[int, int]]:
    """Lookup leaves ``[V, d]`` and ``[d, V]`` leaves read as a head (``Dense(d, V)``, ``h @
    W``) that hold their transpose: a head initialised to ``embedding.T``, a copy."""
    found = []
    for i in lookups:
        for j, x in enumerate(tr.leaves):
            if j != i and split.head_transposed(tr, i, j) and \
                    np.array_equal(np.asarray(tr.leaves[i]), np.asarray(x).T) and \
                    split.survey(tr, j, transposed=True).heads:
                found.append((i, j))
    return found


def discover(spec: str, form: Form, tokens: Any = None, targets: Any = None
             ) -> tuple[Tie, Finding, split.Traced]:
    """The tie: one leaf read by a row lookup and by a head (or declared), else a lookup leaf
    and a head leaf that are one array under two paths, or equal values (a copy)."""
    target = form.target
    if tokens is None:
        tokens, targets = batch(target, _vocab_guess(form.params))
    try:
        tr = split.trace(form.loss, form.params, tokens, targets)
    except Exception as exc:
        raise AdapterError(spec, "tracing the loss raised", key="forward",
                           got=f"{type(exc).__name__}: {exc}") from exc
    out = tr.jaxpr.out_avals
    if len(out) != 1 or out[0].shape != () or not jnp.issubdtype(out[0].dtype, jnp.floating):
        raise AdapterError(spec, "the loss is not a floating scalar", key="loss",
                           expected="a 0-dim float array", got=", ".join(map(str, out)))
    for name in ("table", "head"):
        declared = getattr(target, name)
        if declared is not None and declared not in tr.paths:
            raise AdapterError(spec, f"the declared {name} is not a leaf of the parameter tree",
                               key=name, expected=" or ".join(tr.paths[:12]), got=declared)
    surveys = {i: split.survey(tr, i) for i, x in enumerate(tr.leaves) if np.ndim(x) == 2}
    lookups = [i for i, s in surveys.items() if s.lookups]
    heads = [i for i, s in surveys.items() if s.heads]
    both = [i for i in lookups if i in heads]
    if target.table is not None:
        a = tr.paths.index(target.table)
        b = tr.paths.index(target.head) if target.head is not None else a
    elif both:
        a = b = both[0]
    else:
        pairs = [(i, j) for i in lookups for j in heads
                 if np.shape(tr.leaves[i]) == np.shape(tr.leaves[j])]
        pairs += _transposed_copies(tr, lookups)
        if not pairs:
            raise AdapterError(
                spec, "found no tie", key="table",
                expected="one [V, d] leaf read by a row lookup (nnx.Embed, jnp.take) and by a "
                         "head (.attend, h @ E.T), or JaxTarget(table=...)",
                got=f"lookups read {[tr.paths[i] for i in lookups]}, heads read "
                    f"{[tr.paths[i] for i in heads]}")
        same = [p for p in pairs if tr.leaves[p[0]] is tr.leaves[p[1]]]
        equal = [p for p in pairs if np.array_equal(
            np.asarray(tr.leaves[p[0]]), _as_table(tr, *p))]
        if not (same or equal):
            raise AdapterError(
                spec, "found no tie", key="table",
                expected="the lookup and the head reading one leaf (or two paths of one "
                         "array)", got=f"the lookup reads {tr.paths[pairs[0][0]]} and the head "
                                   f"reads {tr.paths[pairs[0][1]]}, two different matrices")
        a, b = (same or equal)[0]
    V, d = int(np.shape(tr.leaves[a])[0]), int(np.shape(tr.leaves[a])[1])
    E_a, E_b = tr.leaves[a], tr.leaves[b]
    how = "one leaf" if a == b else ("two paths, one array" if E_a is E_b else "copy")
    B, T = (int(n) for n in np.shape(tokens))
    tie = Tie(tr.paths[a], tr.paths[b], V, d, B, T, form.kind, how,
              dtype=str(jnp.asarray(E_a).dtype))
    where = f"{tr.paths[a]} ({form.kind}, [{V}, {d}])"
    if how == "copy":
        found = failed("tie discovered", ONE_LEAF, "tie_is_a_copy",
                       f"the lookup reads {tr.paths[a]} and the head reads {tr.paths[b]}: two "
                       "arrays that hold equal values (a copy made at init, flax #1263), each "
                       "trained by its own path's gradient only")
    elif how == "two paths, one array":
        found = passed("tie discovered", ONE_LEAF,
                       f"{tr.paths[a]} and {tr.paths[b]} are one array under two paths of the "
                       "tree (jax.grad gives each path its own leaf)")
    else:
        found = passed("tie discovered", ONE_LEAF, f"{where}, read by "
                       f"{surveys[a].lookups} lookup(s) and {surveys[a].heads} head(s)")
    return tie, found, tr
