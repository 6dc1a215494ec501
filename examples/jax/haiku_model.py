"""A haiku language model (``hk.transform``) and its ``init`` parameters, as a
``tyingspec.JaxTarget``: haiku's ``apply(params, tokens)`` is called as a Linen module's is.

    tyingspec check examples.jax.haiku_model:target --kind jax
"""

import haiku as hk
import jax
import jax.numpy as jnp

from tyingspec import JaxTarget

VOCAB, WIDTH = 37, 8


def forward(tokens: jnp.ndarray) -> jnp.ndarray:
    embed = hk.Embed(VOCAB, WIDTH)
    x = embed(tokens)
    h = x + jnp.tanh(hk.Linear(WIDTH)(x))
    return h @ embed.embeddings.T  # the head reads the lookup's table: one array, two uses


model = hk.without_apply_rng(hk.transform(forward))
target = JaxTarget(module=model,
                   params=lambda: model.init(jax.random.PRNGKey(0),
                                             jnp.zeros((2, 8), jnp.int32)))
