"""Linear-ce kernels shaped like what shipped, for
``tests/kinds/linear_ce/test_linear_ce_shipped.py``.

Each is the correct code of ``kinds.linear_ce.zoo`` (or torch's own cross-entropy) with one
thing as a released kernel had it: an option taken and ignored (Liger 0.2.0's
``label_smoothing``), ``reduction='none'`` returning the sum (Liger #488), padded vocabulary
lanes in the logsumexp (Liger up to 0.8.0's softcap), a constructor that takes ``**kwargs``
(Liger up to 0.4) or asserts ``reduction`` in mean/sum (Liger 0.6.2), a low-precision branch
that drops the logit scale, and one that computes in float32 and hands back float64; and
Liger's padded lanes again as a torch kernel that runs in bfloat16 and float16.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tyingspec._src.kinds.linear_ce.zoo import _torch_classes, ce_numpy


def ignores_smoothing(h: Any, E: Any, targets: Any, b: Any = None, *, grad_output: Any = None,
                      label_smoothing: float = 0.0, ignore_index: int = -100,
                      reduction: str = "mean") -> Any:
    """Takes label_smoothing and never uses it."""
    return ce_numpy(h, E, targets, b, grad_output=grad_output, ignore_index=ignore_index,
                    reduction=reduction)  # type: ignore[arg-type]


def none_sums(h: Any, E: Any, targets: Any, b: Any = None, *, grad_output: Any = None,
              reduction: str = "mean") -> Any:
    """``reduction='none'`` computes the sum: one number, and the sum's gradients."""
    if reduction == "none":
        return ce_numpy(h, E, targets, b, reduction="sum")
    return ce_numpy(h, E, targets, b, grad_output=grad_output,
                    reduction=reduction)  # type: ignore[arg-type]


def padded_lanes(h: Any, E: Any, targets: Any, b: Any = None, *,
                 softcap: float | None = None) -> Any:
    """Liger's softcap slip: the vocabulary is walked in one block of the next power of two
    of V lanes, the lanes past V loaded as -inf, softcapped to -softcap, and so counted in
    every token's logsumexp (and softmax); their gradient is dropped with them."""
    h, E = np.asarray(h, np.float64), np.asarray(E, np.float64)
    y = np.asarray(targets)
    N, V = h.shape[0], E.shape[0]
    block = 1 << max(4, (V - 1).bit_length())
    u = h @ E.T
    pad = np.full((N, block - V), -np.inf)
    a = np.concatenate([u, pad], axis=1)
    z = a if softcap is None else softcap * np.tanh(a / softcap)
    m = z.max(axis=1, keepdims=True)
    p = np.exp(z - m)
    lse = m[:, 0] + np.log(p.sum(axis=1))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(np.mean(lse - z[np.arange(N), y]))
    g = p[:, :V].copy()
    g[np.arange(N), y] -= 1
    g /= N
    if softcap is not None:
        g *= 1 - np.tanh(u / softcap) ** 2
    return {"loss": loss, "dh": g @ E, "dE": g.T @ h, "db": None}


class KwargsLinearCE(nn.CrossEntropyLoss):
    """Liger up to 0.4's shape: ``**kwargs`` handed to ``nn.CrossEntropyLoss``, which takes
    ignore_index, reduction and label_smoothing and refuses every other option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor,  # type: ignore[override]
                target: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        logits = _input @ lin_weight.T + (0 if bias is None else bias)
        return super().forward(logits, target)


class MeanSumOnly(KwargsLinearCE):
    """Liger 0.6.2's shape: ``reduction: str`` in the signature, an assert on mean/sum."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0,
                 reduction: str = "mean") -> None:
        assert reduction in {"mean", "sum"}, f"reduction must be 'mean' or 'sum', got {reduction}"
        super().__init__(ignore_index=ignore_index, label_smoothing=label_smoothing,
                         reduction=reduction)


def _half_drops_scale() -> type[nn.Module]:
    base: Any = _torch_classes()["ChunkedLinearCE"]

    class HalfDropsScale(base):  # type: ignore[misc, valid-type]
        """The zoo's correct torch kernel, but its bfloat16/float16 branch scales the logits
        in place where autograd does not see it: the backward lacks the logit scale there."""

        def row_losses(self, u: torch.Tensor, y: torch.Tensor,
                       t: torch.Tensor) -> torch.Tensor:
            self.scale_in_graph = u.dtype not in (torch.bfloat16, torch.float16)
            return super().row_losses(u, y, t)  # type: ignore[no-any-return]

    return HalfDropsScale


def half_drops_scale(ignore_index: int = -100, reduction: str = "mean",
                     logit_scale: float = 1.0) -> nn.Module:
    return _half_drops_scale()(ignore_index=ignore_index, reduction=reduction,
                               logit_scale=logit_scale)


def _padded_lanes_torch() -> type[nn.Module]:
    base: Any = _torch_classes()["ChunkedLinearCE"]

    class PaddedLanesTorch(base):  # type: ignore[misc, valid-type]
        """The zoo's correct torch kernel with Liger's softcap slip in every dtype: the
        logits walked in one block of the next power of two of V lanes (at least 16), the
        lanes past V loaded as -inf and softcapped to -softcap, so they enter every token's
        logsumexp; computed in the dtype it is handed (bfloat16, float16 too)."""

        def row_losses(self, u: torch.Tensor, y: torch.Tensor,
                       t: torch.Tensor) -> torch.Tensor:
            c = self.softcap
            if c is None:
                return super().row_losses(u, y, t)  # type: ignore[no-any-return]
            V = u.shape[-1]
            block = 1 << max(4, (V - 1).bit_length())
            a = torch.cat([u * self.logit_scale,
                           u.new_full((u.shape[0], block - V), float("-inf"))], dim=-1)
            z = c * torch.tanh(a / c)
            lse = torch.logsumexp(z, dim=-1)
            zy = z.gather(1, y[:, None])[:, 0]
            eps = self.label_smoothing
            return t * (lse - (1 - eps) * zy - eps * z[:, :V].mean(dim=-1))

    return PaddedLanesTorch


def padded_lanes_torch(ignore_index: int = -100, reduction: str = "mean",
                       softcap: float | None = None) -> nn.Module:
    return _padded_lanes_torch()(ignore_index=ignore_index, reduction=reduction,
                                 softcap=softcap)


class Float32Inside(nn.Module):
    """Computes in float32 whatever it is given and hands back float64 (a Triton kernel's
    float32 accumulators behind a float64 interface): correct, at float32's precision."""

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        logits = _input.float() @ lin_weight.float().T
        return nn.functional.cross_entropy(logits, target).double()
