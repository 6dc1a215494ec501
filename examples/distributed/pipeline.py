"""A pipeline with a tied embedding, as a Megatron-style stack runs it.

The first stage holds the embedding (its copy of E), the last stage the head (its own copy of
E), the blocks are split across the stages in order (a middle stage holds blocks only), and
each stage is replicated over ``dp`` data-parallel ranks.  After the backward, ``finalize_grads``
averages every gradient over the DP group, then sums the two copies' gradients over the
embedding group, so both step by the tied gradient.  Check it with::

    tyingspec check examples.distributed.pipeline:target --kind distributed

It runs on tyingspec's default layouts, pp=2, pp=2 x dp=2 and pp=3.  Break it to see a
label: delete the embedding all-reduce in ``finalize_grads`` (``replica_not_synced``), leave
out its ``group=`` (the world group: ``path_scaled`` on pp=2 x dp=2), or the ``zero_grad`` at
the top of ``step`` (``gradient_not_zeroed``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tyingspec import DistributedTarget

# V above the default batch's 12 x 4 tokens, so that some rows carry the output path alone
V, D, BLOCKS = 61, 8, 2


class Model(nn.Module):
    """The single-process model: the reference.  Its forward returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(BLOCKS))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight  # the tie

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def setup(world):
    full = Model()  # every rank builds the whole model from the same seed, then keeps its part
    s, pp = world.stage, world.pp
    stage = nn.ModuleDict({"blocks": full.blocks[s * BLOCKS // pp:(s + 1) * BLOCKS // pp]})
    if world.first_stage:
        stage["wte"] = full.wte
    if world.last_stage:
        stage.head = nn.Parameter(full.wte.weight.detach().clone())  # the last stage's copy
    return {"stage": stage, "opt": torch.optim.SGD(stage.parameters(), lr=0.1)}, \
        copy_of(world, stage)


def step(world, state, tokens, targets):
    state["opt"].zero_grad()  # every step's gradient is its own
    forward_backward(world, state["stage"], tokens, targets)
    finalize_grads(world, state)
    state["opt"].step()


def forward_backward(world, stage, tokens, targets):
    """GPipe: each micro-batch through every stage of this replica and back."""
    prev = world.rank_of(world.stage - 1, world.replica)
    nxt = world.rank_of(world.stage + 1, world.replica)
    for x, y in zip(world.micro_batches(tokens), world.micro_batches(targets)):
        if world.first_stage:
            h = stage["wte"](x)
        else:
            h_in = torch.empty(x.shape[0], x.shape[1], D)
            dist.recv(h_in, src=prev)
            h = h_in.requires_grad_(True)
        for block in stage["blocks"]:
            h = h + torch.tanh(block(h))
        if world.last_stage:
            logits = F.linear(h, stage.head)
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
            (loss / world.micro_batch_count).backward()
        else:
            dist.send(h.detach(), dst=nxt)
            grad = torch.empty_like(h)
            dist.recv(grad, src=nxt)
            h.backward(grad)
        if not world.first_stage:
            dist.send(h_in.grad, dst=prev)


def finalize_grads(world, state):
    average_replicas(world, state["stage"])
    copy = copy_of(world, state["stage"])
    if copy is not None:
        dist.all_reduce(copy.grad, group=world.embedding_group)  # the two copies, summed


def average_replicas(world, stage):
    for p in stage.parameters():  # the DP replicas of this stage, averaged
        if world.dp > 1 and p.grad is not None:
            dist.all_reduce(p.grad, group=world.dp_group)
            p.grad /= world.dp


def copy_of(world, stage):
    """This stage's copy of E: the lookup's on the first stage, the head on the last."""
    if world.first_stage:
        return stage["wte"].weight
    return stage.head if world.last_stage else None


target = DistributedTarget(reference=Model, embedding="wte.weight", setup=setup, step=step)
