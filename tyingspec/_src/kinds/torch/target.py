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
    """A PyTorch model under test, for what auto-detection cannot find, and the way to check
    the training step you actually run.

    ``model`` is a zero-argument factory returning a fresh ``nn.Module`` on every call.
    ``embedding`` and ``head`` name the two uses of the tied matrix (parameter names as
    ``named_parameters`` spells them, e.g. ``"transformer.wte.weight"`` and
    ``"lm_head.weight"``); by default they are discovered.  ``optimizer`` builds the
    training optimizer from a model; ``retie`` restores the tie after a transformation that
    replaces parameters (``load_state_dict(assign=True)``, ``to_empty()``; default: the
    model's own ``tie_weights()`` if it has one).  ``batch_size`` and ``seq_len`` fix the
    largest batch a check runs (by default ``seq_len`` is the model's whole context, never
    more than its shortest position table, and the batch holds a thousand tokens or more,
    both within the check's budget).  ``after_backward(model)`` runs after every
    ``loss.backward()``, before the tied gradient is read: the step a training stack runs to
    finish it (TransformerEngine's delayed ``backward_dw``, a DeepSpeed-style gradient
    reducer).

    ``step(model, optimizer, batch)`` is your own training step: forward, your loss with your
    masks and labels, backward under your autocast or compile, accumulation over your
    micro-batches, clipping, ``optimizer.step()``.  tyingspec hands it a fresh model, the
    optimizer ``optimizer`` builds (``torch.optim.SGD`` by default) and a :class:`StepBatch`,
    observes every forward it runs, and judges the tied gradient the optimizer steps with
    (and the update it makes) against the reference built from those forwards, at every
    step.  ``autocast`` (``"bfloat16"`` or ``"float16"``) and ``compile`` (True, or a
    ``torch.compile`` backend name) run the check's own passes, or your step's model, under
    ``torch.autocast`` / ``torch.compile``, as ``--autocast`` and ``--compile`` do.

    ``device`` (``"cuda"``, ``"cuda:1"``, any device torch names) is where the check's models
    and the batches it hands them live, as ``--device`` sets it: every model the check trains
    is moved there after it is built, each batch (and your ``step``'s :class:`StepBatch`, and
    the tokens and targets your ``loss`` gets) is moved to the model's device, and the
    gradients and observed uses come back to the CPU, to be judged in float64 with the same
    judgement as on the CPU.  A device torch cannot place a tensor on is an adapter error
    naming it and torch's version.  The checks of the tie's identity and of the optimizer's
    bookkeeping run where your factory builds the model.
    """

    model: Callable[[], Any]
    loss: LossConvention | Callable[[Any, Any, Any], Any] = "auto"
    embedding: str | None = None
    head: str | None = None
    optimizer: Callable[[Any], Any] | None = None
    retie: Callable[[Any], None] | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    after_backward: Callable[[Any], None] | None = None
    step: Callable[[Any, Any, Any], Any] | None = None
    autocast: str | None = None
    compile: bool | str = False
    device: str | None = None

    def __call__(self) -> Any:
        """A fresh model: a target is a factory like any other."""
        return self.model()


@dataclass(frozen=True)
class StepBatch:
    """What a ``TorchTarget(step=...)`` is handed each step: ``input_ids`` ``[B, T]``,
    ``labels`` (transformers' convention: the model shifts them; -100 where ignored),
    ``targets`` (the same tensor, for a model that takes next-token targets), and
    ``attention_mask`` (1 for a real position; None when the case passes none).
    ``micro_batches(k)`` splits it into ``k`` batches of whole sequences, for accumulation."""

    input_ids: Any
    labels: Any
    attention_mask: Any = None

    @property
    def targets(self) -> Any:
        return self.labels

    def micro_batches(self, k: int) -> list[StepBatch]:
        B = int(self.input_ids.shape[0])
        k = max(1, min(int(k), B))
        bounds = [round(i * B / k) for i in range(k + 1)]
        return [StepBatch(self.input_ids[a:b], self.labels[a:b],
                          None if self.attention_mask is None else self.attention_mask[a:b])
                for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
