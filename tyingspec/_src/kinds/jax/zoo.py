"""Built-in JAX targets for the jax kind: tiny tied language models, correct and broken.

One model in three forms (a Flax NNX module, a Linen module with its variables, a pure
``loss_fn``): ``x = E[tokens]``, ``h = x + tanh(x @ W + b)``, ``logits = h @ E.T`` (NNX and
Linen through ``Embed.__call__`` and ``Embed.attend``), mean token cross-entropy.  Each broken
built-in changes one thing, the way the JAX bugs of the catalogue are written:

* ``nnx-copy-tie``: the head is a second Param initialised with a copy of the table (flax
  #1263);
* ``function-custom-vjp-set``: a ``custom_vjp`` lookup whose backward writes
  ``.at[ids].set(g)``: a repeated token keeps its last occurrence only;
* ``function-custom-vjp-head-halved``: a ``custom_vjp`` head whose backward halves the
  table's gradient (a fused head rescaling its path);
* ``nnx-custom-vjp-lookup-dropped``: a ``custom_vjp`` lookup whose backward returns zeros for
  the table (a fused kernel that leaves the table's input path to someone else);
* ``function-two-paths``: the tree holds the table under two paths, and
  ``optax.multi_transform`` labels both: two state slots, one update per path;
* ``function-stale-step``: the training step is ``jax.jit`` of a loss that reads the head's
  table from a closed-over holder (as a step closing over an NNX module does): the compiled
  step keeps the table it was traced with.

Importing this module imports no jax: listing the built-ins stays cheap; each factory imports
jax and flax when it is called (in the worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tyingspec._src.kinds.jax.target import JaxTarget

__all__ = ["JAX_BUILTINS", "JaxBuiltin"]

V, D, B, T = 29, 8, 2, 8  # V not a power of two, so nothing can lean on it being one
_LR = 0.1


@dataclass(frozen=True)
class JaxBuiltin:
    """One built-in jax target: its name, what it breaks and the label a check must reach."""

    name: str
    attr: str  # this module's attribute holding the factory
    description: str
    breaks: str | None
    expected: str


def _arrays(seed: int = 0) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"embed": jax.random.normal(k1, (V, D), jnp.float32),
            "w": jax.random.normal(k2, (D, D), jnp.float32) / D ** 0.5,
            "b": 0.1 * jax.random.normal(k3, (D,), jnp.float32)}


def _ce(logits: Any, targets: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _body(x: Any, w: Any, b: Any) -> Any:
    import jax.numpy as jnp

    return x + jnp.tanh(x @ w + b)


# --- NNX ---------------------------------------------------------------------------------------

def _nnx_model(head: str = "attend") -> Any:
    import jax.numpy as jnp
    from flax import nnx

    class TiedLM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))
            self.b = nnx.Param(jnp.zeros((D,)))
            if head == "copy":
                # flax #1263: a second parameter initialised equal, not the same one
                self.head = nnx.Param(jnp.array(self.embed.embedding[...], copy=True))

        def __call__(self, tokens: Any) -> Any:
            if head == "dropped":
                x = _dropped_lookup(self.embed.embedding[...], tokens)
            else:
                x = self.embed(tokens)
            h = _body(x, self.w[...], self.b[...])
            if head == "copy":
                return h @ self.head[...].T
            return self.embed.attend(h)

    return TiedLM(nnx.Rngs(0))


def nnx_tied() -> Any:
    """The correct NNX model: ``nnx.Embed`` read by ``__call__`` and ``.attend``."""
    return _nnx_model()


def nnx_copy_tie() -> Any:
    return _nnx_model("copy")


def nnx_custom_vjp_lookup_dropped() -> Any:
    return _nnx_model("dropped")


# --- Linen ------------------------------------------------------------------------------------

def linen_tied() -> JaxTarget:
    """The correct Linen model with its ``init`` variables."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            embed = nn.Embed(V, D, name="embed")
            x = embed(tokens)
            h = _body(x, self.param("w", nn.initializers.lecun_normal(), (D, D)),
                      self.param("b", nn.initializers.zeros, (D,)))
            return embed.attend(h)

    module = TiedLM()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((B, T), jnp.int32))
    return JaxTarget(module=module, params=params)


# --- pure functions ---------------------------------------------------------------------------

def _loss(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
    E = p["embed"]
    return _ce(_body(E[tokens], p["w"], p["b"]) @ E.T, targets)


def function_tied() -> JaxTarget:
    """The correct pure ``loss_fn(params, tokens, targets)``, the table declared."""
    return JaxTarget(loss_fn=_loss, params=_arrays, table="embed")


def _set_lookup(added: int = 0) -> Any:
    """A ``custom_vjp`` lookup whose backward adds the first ``added`` tokens' rows and writes
    the rest with ``.set`` (over what is there): a repeated token keeps one of them."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def lookup(E: Any, ids: Any) -> Any:
        return E[ids]

    def fwd(E: Any, ids: Any) -> tuple[Any, Any]:
        return E[ids], (jnp.zeros_like(E), ids)

    def bwd(res: Any, g: Any) -> tuple[Any, None]:
        zeros, ids = res
        flat, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        # the bug: .set keeps one write per row (the last), .add would sum them
        return zeros.at[flat[:added]].add(rows[:added]).at[flat[added:]].set(rows[added:]), \
            None

    lookup.defvjp(fwd, bwd)
    return lookup


def _dropped_lookup(E: Any, ids: Any) -> Any:
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def lookup(E: Any, ids: Any) -> Any:
        return jnp.take(E, ids, axis=0)

    def fwd(E: Any, ids: Any) -> tuple[Any, Any]:
        return jnp.take(E, ids, axis=0), jnp.zeros_like(E)

    def bwd(zeros: Any, g: Any) -> tuple[Any, None]:
        return zeros, None  # the input path left to nobody

    lookup.defvjp(fwd, bwd)
    return lookup(E, ids)


def function_custom_vjp_set() -> JaxTarget:
    lookup = _set_lookup()

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        E = p["embed"]
        return _ce(_body(lookup(E, tokens), p["w"], p["b"]) @ E.T, targets)

    return JaxTarget(loss_fn=loss_fn, params=_arrays)


def _halved_head(only: str | None = None) -> Any:
    """A ``custom_vjp`` head ``h @ E.T`` whose backward halves the table's gradient (a fused
    head rescaling its path); ``only``: for a table of that dtype alone (a kernel's
    low-precision branch)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def head(h: Any, E: Any) -> Any:
        return h @ E.T

    def fwd(h: Any, E: Any) -> tuple[Any, Any]:
        return h @ E.T, (h, E)

    def bwd(res: Any, g: Any) -> tuple[Any, Any]:
        h, E = res
        dE = g.reshape(-1, g.shape[-1]).T @ h.reshape(-1, h.shape[-1])
        if only is None or E.dtype == jnp.dtype(only):
            dE = 0.5 * dE  # the bug: the table's output path halved
        return (g @ E).astype(h.dtype), dE.astype(E.dtype)

    head.defvjp(fwd, bwd)
    return head


def function_custom_vjp_head_halved() -> JaxTarget:
    head = _halved_head()

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        E = p["embed"]
        return _ce(head(_body(E[tokens], p["w"], p["b"]), E), targets)

    return JaxTarget(loss_fn=loss_fn, params=_arrays)


def function_two_paths() -> JaxTarget:
    import optax  # type: ignore[import-untyped]

    def params() -> dict[str, Any]:
        p = _arrays()
        p["head"] = p["embed"]  # one array under two paths
        return p

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        return _ce(_body(p["embed"][tokens], p["w"], p["b"]) @ p["head"].T, targets)

    def optimizer(p: dict[str, Any]) -> Any:
        labels = {k: "tied" if k in ("embed", "head") else "rest" for k in p}
        return optax.multi_transform({"tied": optax.adamw(1e-3), "rest": optax.adamw(1e-3)},
                                     labels)

    return JaxTarget(loss_fn=loss_fn, params=params, optimizer=optimizer)


def function_stale_step() -> JaxTarget:
    import jax

    def make_step(params: dict[str, Any]) -> Any:
        holder = {"table": params["embed"]}  # what a step closing over a module reads

        @jax.jit
        def value_and_grad(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
            def loss(p: dict[str, Any]) -> Any:
                x = _body(p["embed"][tokens], p["w"], p["b"])
                # the bug: the head reads the holder, a constant of the compiled step
                return _ce(x @ holder["table"].T, targets)
            return jax.value_and_grad(loss)(p)

        def step(p: dict[str, Any], tokens: Any, targets: Any) -> tuple[Any, Any]:
            loss, g = value_and_grad(p, tokens, targets)
            new = jax.tree_util.tree_map(lambda a, b: a - _LR * b, p, g)
            holder["table"] = new["embed"]  # the loop keeps the module in step; jit never sees
            return new, loss

        return step

    return JaxTarget(loss_fn=_loss, params=_arrays, step=make_step)


JAX_BUILTINS: dict[str, JaxBuiltin] = {b.name: b for b in [
    JaxBuiltin("nnx-tied", "nnx_tied", "Flax NNX: nnx.Embed read by __call__ and .attend",
               None, "correct"),
    JaxBuiltin("linen-tied", "linen_tied", "Flax Linen: nn.Embed read by __call__ and .attend, "
               "with its init variables", None, "correct"),
    JaxBuiltin("function-tied", "function_tied", "pure loss_fn(params, tokens, targets): "
               "E[tokens] and h @ E.T", None, "correct"),
    JaxBuiltin("nnx-copy-tie", "nnx_copy_tie", "NNX head = nnx.Param(copy of the table): two "
               "arrays, equal values (flax #1263)", "ID", "tie_is_a_copy"),
    JaxBuiltin("function-custom-vjp-set", "function_custom_vjp_set", "custom_vjp lookup "
               "backward .at[ids].set(g): repeated tokens keep one", "DUP",
               "duplicates_not_accumulated"),
    JaxBuiltin("function-custom-vjp-head-halved", "function_custom_vjp_head_halved",
               "custom_vjp head backward halves the table's gradient: output path halved",
               "SCALE", "path_scaled"),
    JaxBuiltin("nnx-custom-vjp-lookup-dropped", "nnx_custom_vjp_lookup_dropped",
               "custom_vjp lookup backward returns zeros for the table: input path dropped",
               "SUM/ROWS", "input_path_missing"),
    JaxBuiltin("function-two-paths", "function_two_paths", "the table under two paths of the "
               "tree, optax.multi_transform labelling both: two slots, two updates", "OPT1",
               "optimizer_sees_tie_twice"),
    JaxBuiltin("function-stale-step", "function_stale_step", "jitted step whose head reads a "
               "closed-over table: stale after the first update", "ID", "tie_lost"),
]}
