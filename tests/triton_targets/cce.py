"""Apple's cut-cross-entropy (``cut_cross_entropy.linear_cross_entropy``, its Triton ``cce``
implementation) as a linear-ce kernel: ``linear_cross_entropy(input, weight, target, ...)``,
with its gradient filter off (``filter_eps=None``: the filter skips softmax entries below a
threshold on purpose, an approximation and not the contract)."""

from __future__ import annotations

from typing import Literal

import torch
from cut_cross_entropy import linear_cross_entropy


class CutCrossEntropy(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, softcap: float | None = None,
                 reduction: Literal["mean", "sum", "none"] = "mean") -> None:
        super().__init__()
        self.ignore_index, self.softcap, self.reduction = ignore_index, softcap, reduction

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(_input, lin_weight, target, ignore_index=self.ignore_index,
                                    softcap=self.softcap, reduction=self.reduction,
                                    filter_eps=None, impl="cce")
