"""``TorchTarget``: how to run a PyTorch model when auto-detection cannot tell.

Importing this module does not import torch: a target module that builds its model lazily can
be resolved (and its kind checked) cheaply, and the worker process imports torch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

#: How the loss is taken from the model:
#: ``labels``: transformers, ``model(input_ids=tokens, labels=targets).loss`` (the model shifts);
#: ``targets``: nanoGPT, ``model(tokens, targets)`` returning ``(logits, loss)`` or the loss;
#: ``logits``: ``model(tokens)`` returns logits and tyingspec applies mean cross-entropy;
#: ``auto``: ``labels`` if ``forward`` takes ``labels``, ``targets`` if it takes a second
#: parameter, else ``logits``.  A callable ``loss(model, tokens, targets) -> scalar tensor``
#: replaces all of them.
LossConvention = Literal["auto", "labels", "targets", "logits"]


@dataclass(frozen=True)
class TorchTarget:
    """A PyTorch model under test, for what auto-detection cannot find.

    ``model`` is a zero-argument factory returning a fresh ``nn.Module`` on every call.
    ``embedding`` and ``head`` name the two uses of the tied matrix (parameter names as
    ``named_parameters`` spells them, e.g. ``"transformer.wte.weight"`` and
    ``"lm_head.weight"``); by default they are discovered.  ``optimizer`` builds the
    training optimizer from a model; ``retie`` restores the tie after a transformation that
    replaces parameters (``load_state_dict(assign=True)``, ``to_empty()``; default: the
    model's own ``tie_weights()`` if it has one).  ``batch_size`` and ``seq_len`` set the
    batch shape (``seq_len`` defaults to the model's context length, at most
    ``MAX_SEQ_LEN`` positions, and never more than its shortest position table).
    ``after_backward(model)`` runs after every ``loss.backward()``, before the tied gradient
    is read: the step a training stack runs to finish it (TransformerEngine's delayed
    ``backward_dw``, a DeepSpeed-style gradient reducer).
    """

    model: Callable[[], Any]
    loss: LossConvention | Callable[[Any, Any, Any], Any] = "auto"
    embedding: str | None = None
    head: str | None = None
    optimizer: Callable[[Any], Any] | None = None
    retie: Callable[[Any], None] | None = None
    batch_size: int = 2
    seq_len: int | None = None
    after_backward: Callable[[Any], None] | None = None

    def __call__(self) -> Any:
        """A fresh model: a target is a factory like any other."""
        return self.model()
