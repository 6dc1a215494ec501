"""The single-process reference, split into the components a distributed step sums.

The reference model is the target's own (``DistributedTarget.reference``), built after the same
seed as every rank.  The global batch splits as the ranks split it (``dp`` replicas, each into
``micro_batches``); for each micro-batch the loss is its mean token cross-entropy scaled by
``1 / (dp * micro_batches)``, so the components sum to the gradient of the whole batch's mean.
Each micro-batch's tied gradient is split by path: the input path is the scatter-add of the
embedding output's gradient (observed by a hook on every ``nn.Embedding`` that reads the tied
matrix) into its token rows, the output path is the rest.  Runs where torch is imported (the
worker, or this process for a built-in).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.kinds.distributed.judge import Part
from tyingspec._src.kinds.distributed.target import DistributedTarget


@dataclass(frozen=True)
class Reference:
    """The reference's start value of E, its components and what the row bound needs."""

    E0: np.ndarray
    components: tuple[Part, ...]  # replica x micro-batch x path, as the judge reads them
    loss: float
    per_position: np.ndarray  # [N, d] each position's input-path row (global batch order)
    tokens: np.ndarray  # [N]
    padding_idx: int | None

    @property
    def total(self) -> np.ndarray:
        out: np.ndarray = np.sum([c.value for c in self.components], axis=0)
        return out

    def path(self, name: str) -> np.ndarray:
        out: np.ndarray = np.sum([c.value for c in self.components if c.path == name], axis=0)
        return out


def tied(spec: str, model: nn.Module, name: str) -> nn.Parameter:
    """The reference model's tied matrix, by the target's name for it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        raise AdapterError(spec, f"the reference model has no parameter {name!r}",
                           key="embedding", expected="a name from named_parameters()",
                           got=", ".join(sorted(params))[:300])
    p = params[name]
    if p.ndim != 2:
        raise AdapterError(spec, "the tied matrix is not 2-D", key="embedding",
                           expected="[V, d]", got=f"shape {tuple(p.shape)}")
    return p


def build_reference(spec: str, target: DistributedTarget, seed: int) -> nn.Module:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(seed)
    try:
        model = target.reference()
    except Exception as exc:
        raise AdapterError(spec, "the reference factory raised",
                           got=f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise AdapterError(spec, "the reference factory did not return an nn.Module",
                           got=type(model).__name__)
    return model


def reference(spec: str, target: DistributedTarget, seed: int, tokens: np.ndarray,
              targets: np.ndarray, dp: int, micro: int, step: int = 0) -> Reference:
    """The components of the reference's tied gradient for this split of the batch, the
    batch of step ``step`` (0-based; the ranks seed each step as this does), taken at the
    reference's E: the ranks start every step from ``setup``'s parameters."""
    model = build_reference(spec, target, seed)
    E = tied(spec, model, target.embedding)
    lookups = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is E]
    if not lookups:
        raise AdapterError(spec, "no nn.Embedding of the reference model reads "
                           f"{target.embedding!r}",
                           key="embedding", expected="the tied matrix's lookup module",
                           got="none found")
    padding = lookups[0].padding_idx
    dx: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        # Tensor.register_hook has no annotations in torch's stubs
        out.register_hook(lambda g: dx.append(g.detach().clone()))  # type: ignore[no-untyped-call]

    handles = [m.register_forward_hook(keep) for m in lookups]
    E0 = E.detach().to(torch.float64).numpy().copy()
    V, d = E.shape
    t = torch.from_numpy(tokens.copy())
    y = torch.from_numpy(targets.copy())
    B = t.shape[0]
    share, per = B // dp, B // dp // micro
    components: list[Part] = []
    per_position = np.zeros((t.numel(), d))
    total = 0.0
    torch.manual_seed(seed + 1 + step)
    try:
        for r in range(dp):
            for m in range(micro):
                lo = r * share + m * per
                xs, ys = t[lo:lo + per], y[lo:lo + per]
                model.zero_grad(set_to_none=True)
                dx.clear()
                try:
                    logits = model(xs)
                    loss = F.cross_entropy(logits.reshape(-1, V), ys.reshape(-1)) / (dp * micro)
                    torch.autograd.backward(loss)
                except Exception as exc:
                    # the single-process model, not a rank: its phase named as such
                    raise AdapterError(
                        spec, f"the reference model raised in its forward or backward (the "
                        f"single-process reference, on replica {r}'s micro-batch {m} of step "
                        f"{step + 1})", got=f"{type(exc).__name__}: {exc}") from exc
                total += float(loss.detach())
                g = torch.zeros(V, d, dtype=torch.float64) if E.grad is None else \
                    E.grad.detach().to(torch.float64)
                rows = torch.zeros(V, d, dtype=torch.float64)
                for one in dx:
                    flat = one.reshape(-1, d).to(torch.float64)
                    rows.index_add_(0, xs.reshape(-1), flat)
                    where = slice(lo * t.shape[1], (lo + per) * t.shape[1])
                    per_position[where] += flat.numpy()
                if padding is not None:
                    rows[padding] = 0.0
                components.append(Part(r, m, "input", rows.numpy().copy()))
                components.append(Part(r, m, "output", (g - rows).numpy().copy()))
    finally:
        for h in handles:
            h.remove()
    return Reference(E0, tuple(components), total, per_position, tokens.reshape(-1).copy(),
                     padding)
