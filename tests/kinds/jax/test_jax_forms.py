"""The jax kind on the forms real JAX code uses, built from the real libraries (flax NNX and
Linen, optax with flax's ``TrainState``, equinox), each tiny: a Linen module whose
``__call__`` has optional arguments (lm1b's ``TransformerLM``), a chunked cross-entropy head
inside ``lax.scan``, lookups under ``jax.checkpoint`` and ``lax.cond``, equinox's
``eqx.nn.Shared`` with its per-token ``jax.vmap(embedding)``, a jitted step that donates its
parameters; and the bugs torch names alike: ``lax.stop_gradient`` on either use (a ``.data``
read in torch: ``*_path_missing``), a ``Dense`` head initialised to ``embedding.T``
(``tie_is_a_copy``), a step closed over a stale ``TrainState.params`` (``tie_lost``).

Each check compiles the model several times (about 20 s for the three split observations
below on a loaded 2-core machine), so every test here runs in the slow tier.
"""

from __future__ import annotations

from typing import Any

# jax reads XLA_FLAGS when its backend starts (the first computation), not at import:
# test_jax_kind's flags are set by then
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_jax_kind  # noqa: F401  (sets this module's XLA flags before jax starts)

from tyingspec import standard_cases
from tyingspec._src.engine.observe import load, observe, own_case
from tyingspec._src.kinds.jax.target import JaxTarget

HERE = "test_jax_forms"
V, D = 29, 8


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"embed": jax.random.normal(k1, (V, D), jnp.float32),
            "w": jax.random.normal(k2, (D, D), jnp.float32) / D ** 0.5}


def _ce(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def stop_lookup():
    def loss_fn(p, t, y):
        E = p["embed"]
        x = jax.lax.stop_gradient(E)[t]
        return _ce((x + jnp.tanh(x @ p["w"])) @ E.T, y)
    return JaxTarget(loss_fn=loss_fn, params=_params)


def stop_lookup_output():
    """``stop_gradient`` on what the lookup read (torch's ``.detach()`` of ``E[t]``), not on
    the table: the reference once stopped there too, and the rows agreed."""
    def loss_fn(p, t, y):
        E = p["embed"]
        x = jax.lax.stop_gradient(E[t])
        return _ce((x + jnp.tanh(x @ p["w"])) @ E.T, y)
    return JaxTarget(loss_fn=loss_fn, params=_params)


def stopped_max():
    """A correct loss whose logsumexp subtracts a stopped max: a stop below a use that
    changes no path's gradient."""
    def loss_fn(p, t, y):
        E = p["embed"]
        x = E[t]
        z = (x + jnp.tanh(x @ p["w"])) @ E.T
        m = jax.lax.stop_gradient(z.max(-1, keepdims=True))
        lse = m[..., 0] + jnp.log(jnp.exp(z - m).sum(-1))
        return jnp.mean(lse - jnp.take_along_axis(z, y[..., None], -1)[..., 0])
    return JaxTarget(loss_fn=loss_fn, params=_params)


def stop_head():
    def loss_fn(p, t, y):
        E = p["embed"]
        x = E[t]
        return _ce((x + jnp.tanh(x @ p["w"])) @ jax.lax.stop_gradient(E).T, y)
    return JaxTarget(loss_fn=loss_fn, params=_params)


def copied_dense():
    from flax import nnx
    class M(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)
            self.head.kernel.value = jnp.array(self.embed.embedding.value.T)
        def __call__(self, t):
            x = self.embed(t)
            return self.head(x + jnp.tanh(x))
    return M()


def _plain(p, t, y):
    E = p["embed"]
    x = E[t]
    return _ce((x + jnp.tanh(x @ p["w"])) @ E.T, y)


def stale_state():
    import optax
    from flax.training import train_state

    def make_step(params):
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))

        @jax.jit
        def step(p, t, y):
            loss, g = jax.value_and_grad(_plain)(state.params, t, y)  # stale: the closure's
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss
        return step
    return JaxTarget(loss_fn=_plain, params=_params, step=make_step)


def donating():
    def make_step(params):
        def step(p, t, y):
            loss, g = jax.value_and_grad(_plain)(p, t, y)
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss
        return jax.jit(step, donate_argnums=0)
    return JaxTarget(loss_fn=_plain, params=_params, step=make_step)


def linen_optional():
    import flax.linen as nn
    class LM(nn.Module):
        @nn.compact
        def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
            emb = nn.Embed(V, D, name="embed")
            x = emb(inputs)
            x = x + nn.Dense(D)(jnp.tanh(x))
            return emb.attend(x)
    m = LM()
    t = jnp.zeros((2, 8), jnp.int32)
    return JaxTarget(module=m, params=lambda: m.init(jax.random.PRNGKey(0), t))


def eqx_shared():
    import equinox as eqx

    class LM(eqx.Module):
        shared: eqx.nn.Shared
        mix: eqx.nn.Linear

        def __init__(self):
            k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
            embedding = eqx.nn.Embedding(V, D, key=k1)
            head = eqx.nn.Linear(D, V, use_bias=False, key=k2)
            self.shared = eqx.nn.Shared((embedding, head), lambda pair: pair[1].weight,
                                        lambda pair: pair[0].weight)
            self.mix = eqx.nn.Linear(D, D, key=k3)

        def __call__(self, tokens):
            embedding, head = self.shared()
            x = jax.vmap(embedding)(tokens)
            x = x + jnp.tanh(jax.vmap(self.mix)(x))
            return jax.vmap(head)(x)
    return LM()


def eqx_params():
    import equinox as eqx
    model = eqx.nn.Embedding(V, D, key=jax.random.PRNGKey(0))
    def loss_fn(m, t, y):
        x = jax.vmap(jax.vmap(m))(t)
        return _ce(x @ m.weight.T, y)
    return JaxTarget(loss_fn=loss_fn, params=model)


def _chunked_ce(head: Any, p: dict[str, Any], t: Any, y: Any) -> Any:
    """The mean cross-entropy with the head applied chunk by chunk inside ``lax.scan`` (as a
    memory-bounded loss does): ``head(h_chunk, E)`` is the chunk's logits."""
    E = p["embed"]
    x = E[t]
    h = (x + jnp.tanh(x @ p["w"])).reshape(-1, D)
    yy = y.reshape(-1)
    chunks = 4 if h.shape[0] % 4 == 0 else 1

    def body(acc: Any, hy: Any) -> Any:
        hc, yc = hy
        logp = jax.nn.log_softmax(head(hc, E), axis=-1)
        return acc - jnp.take_along_axis(logp, yc[:, None], axis=-1).sum(), None

    total, _ = jax.lax.scan(body, jnp.zeros((), h.dtype),
                            (h.reshape(chunks, -1, D), yy.reshape(chunks, -1)))
    return total / h.shape[0]


def scan_head() -> JaxTarget:
    return JaxTarget(loss_fn=lambda p, t, y: _chunked_ce(lambda hc, E: hc @ E.T, p, t, y),
                     params=_params)


def scan_head_halved() -> JaxTarget:
    """The chunked head through a ``custom_vjp`` whose backward halves the table's part."""
    @jax.custom_vjp
    def head(hc: Any, E: Any) -> Any:
        return hc @ E.T

    def fwd(hc: Any, E: Any) -> Any:
        return hc @ E.T, (hc, E)

    def bwd(res: Any, g: Any) -> Any:
        hc, E = res
        return g @ E, 0.5 * g.T @ hc

    head.defvjp(fwd, bwd)
    return JaxTarget(loss_fn=lambda p, t, y: _chunked_ce(head, p, t, y), params=_params)


def cond_remat():
    def loss_fn(p, t, y):
        E = p["embed"]
        look = jax.checkpoint(lambda E, t: E[t])
        # a traced predicate: both branches are in the program
        x = jax.lax.cond(jnp.all(t >= 0), look, lambda E, t: jnp.take(E, t, axis=0), E, t)
        return _ce((x + jnp.tanh(x @ p["w"])) @ E.T, y)
    return JaxTarget(loss_fn=loss_fn, params=_params)


#: target, the label a one-case check gives it (the torch kind's label for the same bug).
FORMS = [
    ("linen_optional", "correct"),
    ("eqx_shared", "correct"),
    ("eqx_params", "correct"),
    ("scan_head", "correct"),
    ("cond_remat", "correct"),
    ("donating", "correct"),
    ("stop_lookup", "input_path_missing"),
    ("stop_lookup_output", "input_path_missing"),
    ("stopped_max", "correct"),
    ("stop_head", "output_path_missing"),
    ("copied_dense", "tie_is_a_copy"),
    ("scan_head_halved", "path_scaled"),
    ("stale_state", "tie_lost"),
]


@pytest.mark.slow
@pytest.mark.parametrize("attr,label", FORMS)
def test_each_real_form_is_checked_and_each_bug_gets_the_torch_kinds_label(
        attr: str, label: str) -> None:
    """Before: the Linen module with optional arguments, the equinox modules and the scan
    head exited 2 (the loss "not a floating scalar", a module called as a factory, "found no
    tie"), the donating step raised "Array has been deleted", ``stop_gradient`` on the
    lookup was ``input_path_wrong`` or "found no tie", the copied Dense head "found no
    tie", the stale ``TrainState`` ``unknown``."""
    assert_one_case_label(f"{HERE}:{attr}", label)


def assert_one_case_label(spec: str, label: str) -> None:
    """``spec``'s label on the standard ``repeated-tokens`` case, in-process; a correct one
    with no failed finding."""
    target = load(spec, "jax", isolate=False)
    case = next(c for c in standard_cases(0) if c.name == "repeated-tokens")
    o = observe(target, own_case(target, case))
    assert o.label == label, o.diagnosis.headline()
    if label == "correct":
        assert not any(f.failed for f in o.diagnosis.findings), o.diagnosis.headline()


def _observed(target: JaxTarget) -> Any:
    from tyingspec._src.kinds.jax import split
    from tyingspec._src.kinds.jax.discover import build_form, discover

    form = build_form("t", target)
    t = jnp.asarray(np.array([[3, 5, 3, 0, 7, 3, 5, 9], [1, 3, 2, 2, 8, 0, 4, 5]]))
    tie, _, tr = discover("t", form, t, jnp.roll(t, -1, axis=-1))
    return split.observe(tr, tr.paths.index(tie.embedding), tr.paths.index(tie.head))


@pytest.mark.slow
def test_the_split_follows_stop_gradient_scan_and_equinox_lookups() -> None:
    """The uses the split sees on the new forms: a lookup under ``stop_gradient`` is a use
    the model stops (the reference still counts it), the four chunks of a scanned head are
    four heads, equinox's ``jax.vmap(embedding)`` is a row lookup; each rebuilds JAX's own
    split of the paths (``problem`` is None)."""
    stopped = _observed(stop_lookup())
    assert stopped.problem is None and not stopped.input_reached and stopped.output_reached
    assert np.any(stopped.dE_in)  # the reference keeps the path the model stops
    scanned = _observed(scan_head())
    assert scanned.problem is None and scanned.heads == 4 and scanned.lookups == 1
    import equinox as eqx

    model = eqx.nn.Embedding(V, D, key=jax.random.PRNGKey(0))
    shared = _observed(JaxTarget(model=eqx_shared))
    assert shared.problem is None and shared.lookups == 1 and shared.heads == 1
    assert model.weight.shape == (V, D)
