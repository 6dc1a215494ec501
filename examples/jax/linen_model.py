"""A Flax Linen language model and its ``init`` variables, as a ``tyingspec.JaxTarget``.

    tyingspec check examples.jax.linen_model:target --kind jax
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from tyingspec import JaxTarget


class TinyLM(nn.Module):
    vocab: int = 37
    width: int = 8

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        embed = nn.Embed(self.vocab, self.width)
        x = embed(tokens)
        h = x + jnp.tanh(nn.Dense(self.width)(x))
        return embed.attend(h)


module = TinyLM()
target = JaxTarget(module=module,
                   params=lambda: module.init(jax.random.PRNGKey(0),
                                              jnp.zeros((2, 8), jnp.int32)))
