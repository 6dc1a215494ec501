"""An equinox language model tied the equinox way: ``eqx.nn.Shared`` makes the head's weight
the embedding's, and the model maps one sequence ``[T]`` to logits ``[T, V]`` (tyingspec vmaps
it over the batch, as equinox code does).

    tyingspec check examples.jax.equinox_model:make_model --kind jax
"""

import equinox as eqx
import jax
import jax.numpy as jnp


class TinyLM(eqx.Module):
    shared: eqx.nn.Shared
    mix: eqx.nn.Linear

    def __init__(self, vocab: int, width: int, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        embedding = eqx.nn.Embedding(vocab, width, key=k1)
        head = eqx.nn.Linear(width, vocab, use_bias=False, key=k2)
        # the head's weight is the embedding's: Shared puts the one array in both places
        self.shared = eqx.nn.Shared((embedding, head), lambda m: m[1].weight,
                                    lambda m: m[0].weight)
        self.mix = eqx.nn.Linear(width, width, key=k3)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        embedding, head = self.shared()
        x = jax.vmap(embedding)(tokens)
        h = x + jnp.tanh(jax.vmap(self.mix)(x))
        return jax.vmap(head)(h)  # logits [T, V]


def make_model() -> TinyLM:
    return TinyLM(37, 8, jax.random.PRNGKey(0))
