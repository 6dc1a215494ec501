"""``JaxTarget``: a JAX or Flax model under test, in any of the three forms the jax kind takes.

Importing this module does not import jax: a target module can be resolved (and its kind
checked) cheaply, and the worker process imports jax itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``make_step(params) -> step``, ``step(params, tokens, targets) -> (new_params, loss)``: a
#: training step as the target's own training loop builds and runs it (jitted as it is there).
MakeStep = Callable[[Any], Callable[[Any, Any, Any], tuple[Any, Any]]]


@dataclass(frozen=True)
class JaxTarget:
    """A JAX model under test.  Give one of:

    * ``model``: a zero-argument factory returning a Flax NNX module (a bare factory given as
      the target is this form).  ``module(tokens)`` returns logits [B, T, V] and tyingspec
      takes their mean token cross-entropy against ``targets``; a ``__call__`` that takes a
      second argument is called ``module(tokens, targets)`` and returns the loss.
    * ``module`` and ``params``: a Linen module and its ``init`` variables (the dict holding
      ``"params"``), called ``module.apply(params, tokens)`` by the same convention.
    * ``loss_fn`` and ``params``: a pure ``loss_fn(params, tokens, targets) -> scalar``.

    ``params`` may be a zero-argument factory of the tree.  ``table`` names the tied table's
    path in the parameter tree (``"params/embed/embedding"``, keys joined by ``/``) and
    ``head`` the head's leaf when the target ties by holding one array under two paths; by
    default both are discovered (a leaf used by a row lookup and by a head).  ``optimizer``
    builds the target's optax optimizer from the parameter tree; ``step`` is its training
    step (see :data:`MakeStep`; default: tyingspec's own ``jax.jit`` SGD step).
    ``seq_len`` (and ``batch_size``) fix the batch every case runs; by default each case
    draws its own, up to the model's whole context (see :mod:`kinds.jax.setting`).
    """

    model: Callable[[], Any] | None = None
    module: Any = None
    params: Any = None
    loss_fn: Callable[[Any, Any, Any], Any] | None = None
    table: str | None = None
    head: str | None = None
    optimizer: Callable[[Any], Any] | None = None
    step: MakeStep | None = None
    batch_size: int | None = None
    seq_len: int | None = None

    def __call__(self) -> JaxTarget:
        """The target itself: a target is a factory like any other."""
        return self
