"""A pure ``loss_fn(params, tokens, targets)`` with its parameter tree; the table's path is
declared (``table="embed"``), though the check would find it.

    tyingspec check examples.jax.loss_fn:target --kind jax
"""

import jax
import jax.numpy as jnp

from tyingspec import JaxTarget


def init() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"embed": jax.random.normal(k1, (37, 8)),
            "w": jax.random.normal(k2, (8, 8)) / 8 ** 0.5}


def loss_fn(params: dict[str, jax.Array], tokens: jax.Array, targets: jax.Array) -> jax.Array:
    E = params["embed"]
    x = E[tokens]
    h = x + jnp.tanh(x @ params["w"])
    logp = jax.nn.log_softmax(h @ E.T, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


target = JaxTarget(loss_fn=loss_fn, params=init, table="embed")
