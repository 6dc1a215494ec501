"""The jax kind on the forms real JAX code uses, built from the real libraries (flax NNX and
Linen, optax with flax's ``TrainState``, equinox, DeepMind's haiku), each tiny: a Linen module
whose ``__call__`` has optional arguments (lm1b's ``TransformerLM``), a chunked cross-entropy
head inside ``lax.scan``, lookups under ``jax.checkpoint`` and ``lax.cond``, equinox's
``eqx.nn.Shared`` with its per-token ``jax.vmap(embedding)``, a jitted step that donates its
parameters, haiku's ``hk.transform`` of ``hk.Embed``, ``hk.MultiHeadAttention`` and
``hk.Linear``; and the bugs torch names alike: ``lax.stop_gradient`` on either use (a ``.data``
read in torch: ``*_path_missing``), a head initialised to the table (``tie_is_a_copy``), a
``custom_vjp`` lookup writing ``.at[ids].set`` (``duplicates_not_accumulated``), a head whose
backward halves the table's part (``path_scaled``), a step closed over a stale
``TrainState.params`` (``tie_lost``).  The library bugs are one matrix (:data:`LIBRARIES` x
:data:`BUGS`): each library's own tied LM, correct and with each bug.

Each check compiles the model several times (about 20 s for the three split observations
below on a loaded 2-core machine), so every test here runs in the slow tier."""

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
            self.head.kernel[...] = jnp.array(self.embed.embedding[...].T)
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


def _halved_head() -> Any:
    """A head ``h @ E.T`` through a ``custom_vjp`` whose backward halves the table's part: the
    output path enters with a stray 1/2, as a hand-written fused head's bug does."""
    @jax.custom_vjp
    def head(hc: Any, E: Any) -> Any:
        return hc @ E.T

    def fwd(hc: Any, E: Any) -> Any:
        return hc @ E.T, (hc, E)

    def bwd(res: Any, g: Any) -> Any:
        hc, E = res
        flat_h, flat_g = hc.reshape(-1, hc.shape[-1]), g.reshape(-1, g.shape[-1])
        return g @ E, 0.5 * flat_g.T @ flat_h

    head.defvjp(fwd, bwd)
    return head


def scan_head_halved() -> JaxTarget:
    """The chunked head through a ``custom_vjp`` whose backward halves the table's part."""
    return JaxTarget(loss_fn=lambda p, t, y: _chunked_ce(_halved_head(), p, t, y),
                     params=_params)


def cond_remat():
    def loss_fn(p, t, y):
        E = p["embed"]
        look = jax.checkpoint(lambda E, t: E[t])
        # a traced predicate: both branches are in the program
        x = jax.lax.cond(jnp.all(t >= 0), look, lambda E, t: jnp.take(E, t, axis=0), E, t)
        return _ce((x + jnp.tanh(x @ p["w"])) @ E.T, y)
    return JaxTarget(loss_fn=loss_fn, params=_params)


# --- one matrix: each library's own tied LM, correct and with each bug torch names ---------
#: bug -> the torch kind's label for it: ``stop_gradient`` on what the lookup read (torch's
#: ``.detach()``) or on the head's table (a ``.data`` read), a head initialised from the table
#: (a copy), a ``custom_vjp`` lookup whose backward writes with ``.at[ids].set`` (torch's
#: ``index_put_`` without ``accumulate``), a head whose backward halves the table's part.
BUGS = {"tied": "correct", "stop_lookup": "input_path_missing",
        "stop_head": "output_path_missing", "copy": "tie_is_a_copy",
        "set_lookup": "duplicates_not_accumulated", "halved_head": "path_scaled"}


def _lookup(bug: str, native: Any, table: Any, t: Any) -> Any:
    """The lookup of ``t`` as ``bug`` writes it; ``native(t)`` is the library's own."""
    from tyingspec._src.kinds.jax.zoo import _set_lookup

    if bug == "set_lookup":
        return _set_lookup()(table, t)
    return jax.lax.stop_gradient(native(t)) if bug == "stop_lookup" else native(t)


def _head(bug: str, native: Any, table: Any, h: Any) -> Any:
    """The logits of ``h`` as ``bug`` writes them (``copy`` is built by each library);
    ``native(h)`` is the library's own tied head."""
    if bug == "stop_head":
        return h @ jax.lax.stop_gradient(table).T
    return _halved_head()(h, table) if bug == "halved_head" else native(h)


def haiku_lm(bug: str = "tied") -> JaxTarget:
    """A haiku LM (``hk.transform``): ``hk.Embed`` read by its ``__call__``, one
    ``hk.MultiHeadAttention`` block and an ``hk.Linear``, the head ``h @ embed.embeddings.T``;
    given as haiku's own ``(init, apply)`` pair, ``apply(params, tokens)`` its logits."""
    import haiku as hk

    def forward(t: Any) -> Any:
        emb = hk.Embed(V, D, name="embed")
        x = _lookup(bug, emb, emb.embeddings, t)
        attn = hk.MultiHeadAttention(num_heads=2, key_size=D // 2, model_size=D,
                                     w_init=hk.initializers.VarianceScaling(1.0))
        x = x + attn(x, x, x)
        x = x + jnp.tanh(hk.Linear(D)(x))
        if bug == "copy":  # a head initialised from the table: two params, equal values
            return hk.Linear(V, with_bias=False, name="head",
                             w_init=lambda shape, dtype: emb.embeddings.T)(x)
        return _head(bug, lambda h: h @ emb.embeddings.T, emb.embeddings, x)

    f = hk.without_apply_rng(hk.transform(forward))
    return JaxTarget(module=f, params=lambda: f.init(jax.random.PRNGKey(0),
                                                     jnp.zeros((2, 8), jnp.int32)))


def haiku_loss_fn() -> JaxTarget:
    """The same haiku LM given as a pure loss function of haiku's parameter tree."""
    lm = haiku_lm()
    return JaxTarget(loss_fn=lambda p, t, y: _ce(lm.module.apply(p, t), y), params=lm.params)


def linen_lm(bug: str = "tied") -> JaxTarget:
    """A Linen LM: ``nn.Embed`` read by ``__call__`` and scored by ``.attend``."""
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, inputs: Any) -> Any:
            emb = nn.Embed(V, D, name="embed")
            x = _lookup(bug, emb, emb.embedding, inputs)
            x = x + nn.Dense(D)(jnp.tanh(x))
            if bug == "copy":  # a Dense head [D, V] initialised to embedding.T
                return nn.Dense(V, use_bias=False, name="head",
                                kernel_init=lambda *_: emb.embedding.T)(x)
            return _head(bug, emb.attend, emb.embedding, x)

    m = LM()
    return JaxTarget(module=m, params=lambda: m.init(jax.random.PRNGKey(0),
                                                     jnp.zeros((2, 8), jnp.int32)))


def nnx_lm(bug: str = "tied") -> Any:
    """An NNX LM: ``nnx.Embed`` read by ``__call__`` and scored by ``.attend``."""
    if bug == "copy":
        return copied_dense()
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.mix = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, t: Any) -> Any:
            table = self.embed.embedding[...]
            x = _lookup(bug, self.embed, table, t)
            x = x + jnp.tanh(self.mix(x))
            return _head(bug, self.embed.attend, table, x)
    return LM()


def eqx_lm(bug: str = "tied") -> Any:
    """An equinox LM written per sequence (``jax.vmap`` over tokens, as equinox's examples
    do): the ``eqx.nn.Shared`` tie of :func:`eqx_shared`, or for ``copy`` a head whose weight
    is set from the embedding's with ``eqx.tree_at`` (two arrays, equal values)."""
    import equinox as eqx

    class LM(eqx.Module):
        pair: Any  # eqx.nn.Shared of (embedding, head), or the two apart for ``copy``
        mix: eqx.nn.Linear

        def __init__(self) -> None:
            k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
            embedding = eqx.nn.Embedding(V, D, key=k1)
            head = eqx.nn.Linear(D, V, use_bias=False, key=k2)
            if bug == "copy":
                self.pair = (embedding, eqx.tree_at(lambda lin: lin.weight, head,
                                                    jnp.array(embedding.weight)))
            else:
                self.pair = eqx.nn.Shared((embedding, head), lambda pair: pair[1].weight,
                                          lambda pair: pair[0].weight)
            self.mix = eqx.nn.Linear(D, D, key=k3)

        def __call__(self, tokens: Any) -> Any:
            embedding, head = self.pair if isinstance(self.pair, tuple) else self.pair()
            x = _lookup(bug, jax.vmap(embedding), embedding.weight, tokens)
            x = x + jnp.tanh(jax.vmap(self.mix)(x))
            return _head(bug, jax.vmap(head), head.weight, x)
    return LM()


LIBRARIES = {"haiku": haiku_lm, "linen": linen_lm, "nnx": nnx_lm, "eqx": eqx_lm}
# each cell a module attribute, so that a spec names it (``test_jax_forms:haiku_stop_head``)
for _lib, _make in LIBRARIES.items():
    for _bug in BUGS:
        globals()[f"{_lib}_{_bug}"] = (lambda make, bug: lambda: make(bug))(_make, _bug)


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
    ("haiku_loss_fn", "correct"),
] + [(f"{lib}_{bug}", label) for lib in LIBRARIES for bug, label in BUGS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("attr,label", FORMS)
def test_each_real_form_is_checked_and_each_bug_gets_the_torch_kinds_label(
        attr: str, label: str) -> None:
    """Before: the Linen module with optional arguments, the equinox modules and the scan
    head exited 2 (the loss "not a floating scalar", a module called as a factory, "found no
    tie"), the donating step raised "Array has been deleted", ``stop_gradient`` on the
    lookup was ``input_path_wrong`` or "found no tie", the copied Dense head "found no
    tie", the stale ``TrainState`` ``unknown``; equinox's stopped per-token lookup "no
    power"."""
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
    # equinox's per-token lookup squeezes what it gathered before the stop: still the lookup's
    # output (before: the stop was the model's own arithmetic, the check "no power")
    stopped_eqx = _observed(JaxTarget(model=lambda: eqx_lm("stop_lookup")))
    assert stopped_eqx.problem is None and not stopped_eqx.input_reached
    assert stopped_eqx.output_reached and np.any(stopped_eqx.dE_in)
    assert model.weight.shape == (V, D)


@pytest.mark.slow
def test_the_haiku_example_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/jax/haiku_model.py``, haiku's ``(init, apply)`` pair given as a Linen
    module is: correct, its tie one leaf of haiku's parameter tree, the form named haiku
    (before: "linen")."""
    from pathlib import Path

    from test_jax_kind import _describe

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))  # the checkout's
    from examples.jax.haiku_model import target

    tie = _describe("examples.jax.haiku_model:target", target)
    assert (tie["form"], tie["embedding"], tie["head"], tie["how"]) == (
        "haiku", "embed/embeddings", "embed/embeddings", "one leaf")
    assert_one_case_label("examples.jax.haiku_model:target", "correct")
