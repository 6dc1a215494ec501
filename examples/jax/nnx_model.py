"""A Flax NNX language model tied the Flax way: one ``nnx.Embed`` reads with ``__call__``
and scores with ``.attend``.

    tyingspec check examples.jax.nnx_model:make_model --kind jax
"""

import jax.numpy as jnp
from flax import nnx


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.mix = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        x = self.embed(tokens)
        h = x + jnp.tanh(self.mix(x))
        return self.embed.attend(h)  # logits [B, T, V]; tyingspec takes the mean CE


def make_model() -> TinyLM:
    return TinyLM(37, 8, nnx.Rngs(0))
