"""Check what you actually run: a nanoGPT under your own training step.

    tyingspec check examples.torch_step.step:target --kind torch

``step`` is a training step as a loop runs it: four accumulation micro-batches under bfloat16
autocast, gradient clipping and AdamW.  tyingspec hands it a fresh model, the optimizer
``optimizer`` builds and a ``tyingspec.StepBatch`` (``input_ids``, ``labels`` with -100 at
padded positions, ``attention_mask``, ``micro_batches(k)``), observes every forward it takes and
judges the tied gradient the optimizer steps with at every step.  Move ``optimizer.zero_grad()``
into the loop and the check exits 1 with ``gradient_assigned``.
"""

import torch
from torch.nn import functional as F

from examples.torch_nanogpt.model import GPT
from tyingspec import StepBatch, TorchTarget


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def step(model: GPT, optimizer: torch.optim.Optimizer, batch: StepBatch) -> None:
    optimizer.zero_grad()
    parts = batch.micro_batches(4)
    for part in parts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = model(part.input_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), part.labels.flatten(),
                               ignore_index=-100)
        (loss / len(parts)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


target = TorchTarget(model=GPT, optimizer=optimizer, step=step)
