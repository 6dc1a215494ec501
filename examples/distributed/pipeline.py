"""A two-stage pipeline with a tied embedding, as a Megatron-style stack runs it.

Stage 0 holds the embedding (its copy of E), stage 1 the head (its own copy of E).  After the
backward, ``finalize_grads`` all-reduces the two copies' gradients over the embedding group, so
both step by the tied gradient.  Check it with::

    tyingspec check examples.distributed.pipeline:target --kind distributed

and break it (delete the all-reduce in ``finalize_grads``) to see ``replica_not_synced``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tyingspec import DistributedTarget

V, D = 23, 8


class Model(nn.Module):
    """The single-process model: the reference.  Its forward returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.body0, self.body1 = nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight  # the tie

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body0(self.wte(x)))
        return self.head(h + torch.tanh(self.body1(h)))


def setup(world):
    full = Model()  # every rank builds the whole model from the same seed, then keeps its part
    if world.first_stage:
        stage = nn.ModuleDict({"wte": full.wte, "body0": full.body0})
        copy = full.wte.weight
    else:
        stage = nn.ModuleDict({"body1": full.body1})
        stage.head = nn.Parameter(full.wte.weight.detach().clone())  # the last stage's copy
        copy = stage.head
    return {"stage": stage, "opt": torch.optim.SGD(stage.parameters(), lr=0.1)}, copy


def step(world, state, tokens, targets):
    stage, other = state["stage"], 1 - world.rank
    for x, y in zip(world.micro_batches(tokens), world.micro_batches(targets)):
        if world.first_stage:
            h = torch.tanh(stage["body0"](stage["wte"](x)))
            dist.send(h.detach(), dst=other)
            grad = torch.empty_like(h)
            dist.recv(grad, src=other)
            h.backward(grad)
        else:
            h = torch.empty(x.shape[0], x.shape[1], D)
            dist.recv(h, src=other)
            h.requires_grad_(True)
            logits = F.linear(h + torch.tanh(stage["body1"](h)), stage.head)
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
            (loss / world.micro_batch_count).backward()
            dist.send(h.grad, dst=other)
    finalize_grads(world, state)
    state["opt"].step()


def finalize_grads(world, state):
    copy = state["stage"]["wte"].weight if world.first_stage else state["stage"].head
    dist.all_reduce(copy.grad, group=world.embedding_group)  # the two copies, summed


target = DistributedTarget(reference=Model, embedding="wte.weight", setup=setup, step=step,
                           layouts=[(2, 1)], micro_batches=2, batch_size=4, seq_len=5)
