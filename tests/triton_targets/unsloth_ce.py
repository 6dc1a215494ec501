"""Unsloth's Triton cross-entropy (``unsloth.kernels.cross_entropy_loss``) as a linear-ce
kernel.  Unsloth has no fused linear cross-entropy class: its kernel takes the logits, so this
computes them (``input @ weight.T``) and calls ``fast_cross_entropy_loss`` as Unsloth's own
loss patch does, with the batch as one sequence.  Its options map to the kernel's arguments:
``softcap`` to ``logit_softcapping`` and ``logit_scale`` to ``logit_scaling`` (0 is off in
both), ``reduction="sum"`` to ``n_items=1`` (transformers' ``num_items_in_batch``), and the
kernel ignores targets of -100 only, so another ``ignore_index`` is mapped to it.  Nothing in
the kernel is changed."""

from __future__ import annotations

from typing import Literal

import torch
from unsloth.kernels.cross_entropy_loss import fast_cross_entropy_loss


class UnslothCrossEntropy(torch.nn.Module):
    #: Unsloth's kernels launch one program per token (a grid of (rows,) forward, (rows,
    #: vocabulary blocks) backward): it has no token block, and its 4096 is a vocabulary block,
    #: which the long case would otherwise take for one (8177 interpreted tokens, minutes a call)
    tyingspec_block = 1

    def __init__(self, ignore_index: int = -100, softcap: float | None = None,
                 logit_scale: float = 1.0, reduction: Literal["mean", "sum"] = "mean") -> None:
        super().__init__()
        self.ignore_index, self.softcap = ignore_index, softcap
        self.logit_scale, self.reduction = logit_scale, reduction

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        logits = _input @ lin_weight.T
        target = torch.where(target == self.ignore_index, -100, target)
        return fast_cross_entropy_loss(  # type: ignore[no-any-return]
            logits[None], target[None], logit_softcapping=self.softcap or 0,
            logit_scaling=0 if self.logit_scale == 1.0 else self.logit_scale,
            n_items=1 if self.reduction == "sum" else None)
