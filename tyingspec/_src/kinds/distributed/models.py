"""The built-in targets' code: a tiny tied GPT and the distributed steps run on it.

Imported by the ranks (and the reference) only; :mod:`kinds.distributed.zoo` names these
functions lazily, so listing the built-ins imports no torch.  Every step follows the shape of
the training stack it stands for: a Megatron-style pipeline (GPipe over ``send``/``recv``, any
number of stages, a middle one holding no copy; then ``finalize_model_grads``: the DP
all-reduce, then the embedding-group all-reduce of the two copies), ``torch.distributed.
pipelining``, DDP and FSDP2.  Every correct step zeroes its gradients first, as a training loop
does.  Each broken one changes one thing, as the issue it cites did.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tyingspec._src.kinds.distributed.target import World

# V not a power of two, so nothing leans on it, and above the default batch's 48 tokens, so
# that some rows carry the output path alone
V, D, T, LAYERS = 53, 8, 6, 2
LR = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        # a module's call is untyped (Any) in torch's stubs: the annotations say what it is
        x = x + self.proj(att @ v)
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """GPT-2 in miniature: token and position embeddings, causal blocks, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight  # the tie

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        logits: torch.Tensor = self.lm_head(self.ln_f(h))
        return logits


def reference() -> TinyGPT:
    return TinyGPT()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- a Megatron-style pipeline: stage 0 the embedding, the blocks split across the stages in
# order, the last stage the final norm and its own copy of E as the head; a middle stage (pp >=
# 3) holds blocks only ----------------------------------------------------------------------

class Stage(nn.Module):
    def __init__(self, world: World, full: TinyGPT, *, init_sync: bool = True) -> None:
        super().__init__()
        s, pp = world.stage, world.pp
        self.first, self.last = world.first_stage, world.last_stage
        self.blocks = nn.ModuleList(full.blocks[s * LAYERS // pp:(s + 1) * LAYERS // pp])
        if self.first:
            self.wte, self.wpe = full.wte, full.wpe
        if self.last:
            self.ln_f = full.ln_f
            # Megatron's initialize_word_embeddings: the last stage's copy starts at zero and
            # the embedding-group all-reduce makes it the first stage's E
            self.head = nn.Parameter(torch.zeros_like(full.wte.weight))
        copy = self.copy()
        if init_sync and world.pp > 1 and copy is not None:
            with torch.no_grad():
                dist.all_reduce(copy.data, group=world.embedding_group)

    def copy(self) -> torch.Tensor | None:
        """This stage's copy of E (None on a middle stage)."""
        if self.first:
            return self.wte.weight
        return self.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1])) if self.first else x
        for b in self.blocks:
            h = b(h)
        return h

    def logits(self, h: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(self.ln_f(h), self.head if head is None else head)


def pipeline_setup(world: World, *, init_sync: bool = True) -> tuple[Any, Any]:
    stage = Stage(world, TinyGPT(), init_sync=init_sync)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    return {"stage": stage, "opt": opt}, stage.copy()


def _pipeline_backward(world: World, stage: Stage, tokens: torch.Tensor, targets: torch.Tensor,
                       defer_from: int | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """GPipe over send/recv, one micro-batch at a time through every stage.  From micro-batch
    ``defer_from`` on, the last stage computes its head with a detached weight and returns
    the (input, logits gradient) pairs whose product is the head's weight gradient: a wgrad
    deferred (Megatron's defer_embedding_wgrad_compute)."""
    M = world.micro_batch_count
    nxt = world.rank_of(world.stage + 1, world.replica) if not world.last_stage else None
    prv = world.rank_of(world.stage - 1, world.replica) if not world.first_stage else None
    deferred = []
    for m, (x, y) in enumerate(zip(world.micro_batches(tokens), world.micro_batches(targets))):
        if world.first_stage:
            h = stage(x)
        else:
            h_in = torch.empty(x.shape[0], x.shape[1], D)
            dist.recv(h_in, src=prv)
            h_in.requires_grad_(True)
            h = stage(h_in)
        if world.last_stage:
            if defer_from is None or m < defer_from:
                loss = _loss(stage.logits(h), y) / M
            else:
                z = stage.ln_f(h)
                logits = F.linear(z, stage.head.detach())
                logits.retain_grad()
                loss = _loss(logits, y) / M
            torch.autograd.backward(loss)
            if defer_from is not None and m >= defer_from:
                assert logits.grad is not None  # retained above
                deferred.append((z.detach(), logits.grad.detach()))
        else:
            dist.send(h.detach().contiguous(), dst=nxt)
            g = torch.empty_like(h)
            dist.recv(g, src=nxt)
            torch.autograd.backward(h, g)
        if not world.first_stage:
            assert h_in.grad is not None  # a leaf that requires grad, used by the stage
            dist.send(h_in.grad.contiguous(), dst=prv)
    return deferred


def _dp_all_reduce(world: World, stage: nn.Module) -> None:
    if world.dp > 1:
        for p in stage.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=world.dp_group)
                p.grad /= world.dp


def _embedding_all_reduce(world: World, copy: torch.Tensor | None) -> None:
    if world.pp > 1 and copy is not None:
        dist.all_reduce(copy.grad, group=world.embedding_group)


def _grad_of(copy: torch.Tensor) -> torch.Tensor:
    """The copy's gradient, made zero if its stage's backward left none (a deferred head)."""
    if copy.grad is None:
        copy.grad = torch.zeros_like(copy)
    return copy.grad


def pipeline_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                  ) -> None:
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    _pipeline_backward(world, stage, tokens, targets)
    _dp_all_reduce(world, stage)  # finalize_model_grads: DP first ...
    _embedding_all_reduce(world, stage.copy())  # ... then the two copies summed
    opt.step()


def not_synced_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> None:
    """piper #13: the copies are duplicated per stage and never synchronised."""
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    _pipeline_backward(world, stage, tokens, targets)
    _dp_all_reduce(world, stage)
    opt.step()


def synced_early_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor,
                      defer_from: int = 0) -> None:
    """Megatron-LM #1012: the head's weight gradient is deferred (defer_embedding_wgrad_
    compute) and ``finish_embedding_wgrad_compute`` runs after the grad all-reduce."""
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    deferred = _pipeline_backward(world, stage, tokens, targets, defer_from=defer_from)
    _dp_all_reduce(world, stage)
    copy = stage.copy()
    if copy is not None:
        _grad_of(copy)
    _embedding_all_reduce(world, copy)
    for z, g in deferred:  # finish_embedding_wgrad_compute, too late
        _grad_of(stage.head).add_(g.reshape(-1, V).T @ z.reshape(-1, D))
    opt.step()


def late_micro_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> None:
    """The head's wgrad deferred past the sync only from the third micro-batch on (a schedule
    that defers once its warm-up micro-batches are done): right with two micro-batches."""
    synced_early_step(world, state, tokens, targets, defer_from=2)


def not_zeroed_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> None:
    """The correct pipeline step without its ``zero_grad``: right on a fresh setup, and from
    the second step on every copy's gradient also holds the last step's (summed again)."""
    stage, opt = state["stage"], state["opt"]
    _pipeline_backward(world, stage, tokens, targets)
    _dp_all_reduce(world, stage)
    _embedding_all_reduce(world, stage.copy())
    opt.step()


def world_group_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                     ) -> None:
    """The copies summed over the world group, not the embedding group (a group argument
    left out): right where the two coincide (pp=2 x dp=1); on pp=2 x dp=2 every copy holds
    the sum of four, twice the tied gradient.  A stage without a copy joins with zeros, as a
    collective over the world must."""
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    _pipeline_backward(world, stage, tokens, targets)
    _dp_all_reduce(world, stage)
    copy = stage.copy()
    dist.all_reduce(_grad_of(copy) if copy is not None else torch.zeros(V, D))
    opt.step()


def averaged_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                  ) -> None:
    """The embedding group averages the copies' gradients (as a DP reduction does) instead of
    summing them: each copy steps by half the tied gradient."""
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    _pipeline_backward(world, stage, tokens, targets)
    _dp_all_reduce(world, stage)
    copy = stage.copy()
    if copy is not None:
        dist.all_reduce(copy.grad, group=world.embedding_group)
        copy.grad /= len(world.embedding_ranks)
    opt.step()


def partial_shards_step(world: World, state: Any, tokens: torch.Tensor,
                        targets: torch.Tensor) -> None:
    """Megatron-LM #844: with the distributed optimizer each stage's gradients live in one
    contiguous buffer that is reduce-scattered across DP *before* the embedding all-reduce.
    wte is the first weight of stage 0's buffer, the head copy the last of the last stage's,
    so they fall in different DP ranks' shards, and the all-reduce adds partial results."""
    stage, opt = state["stage"], state["opt"]
    opt.zero_grad()
    _pipeline_backward(world, stage, tokens, targets)
    copy = stage.copy()
    others = [p for p in stage.parameters() if p is not copy]
    params = others if copy is None else [copy, *others] if world.first_stage else \
        [*others, copy]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buffer = torch.cat([p.grad.reshape(-1) for p in params])
    reduced = buffer.clone()
    dist.all_reduce(reduced, group=world.dp_group)  # reduce-scatter: each rank keeps its shard
    reduced /= world.dp
    n = math.ceil(buffer.numel() / world.dp)
    lo, hi = world.replica * n, min((world.replica + 1) * n, buffer.numel())
    buffer[lo:hi] = reduced[lo:hi]  # outside its shard a rank's buffer keeps its local grads
    at = 0
    for p in params:
        p.grad.copy_(buffer[at:at + p.numel()].reshape(p.shape))
        at += p.numel()
    _embedding_all_reduce(world, copy)  # after the reduce-scatter: partial shards added
    opt.step()


def init_diverge_setup(world: World) -> tuple[Any, Any]:
    """Megatron's initialize_word_embeddings without its all-reduce: the last stage's copy
    stays at its zero initialisation while the first stage's is E."""
    return pipeline_setup(world, init_sync=False)


def steps_differ_setup(world: World) -> tuple[Any, Any]:
    """An output-layer lr multiplier: the last stage's optimizer steps its copy of E with a
    different learning rate from the first stage's, so the synced copies part after one
    step."""
    stage = Stage(world, TinyGPT())
    copy = stage.copy()
    rest = [p for p in stage.parameters() if p is not copy]
    lr = LR * (2.0 if world.last_stage and not world.first_stage else 1.0)
    groups: list[dict[str, Any]] = [{"params": rest}] + \
        ([{"params": [copy], "lr": lr}] if copy is not None else [])
    opt = torch.optim.SGD(groups, lr=LR)
    return {"stage": stage, "opt": opt}, copy


# ---- torch.distributed.pipelining --------------------------------------------------------------

def pipelining_setup(world: World) -> tuple[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = Stage(world, TinyGPT())

    class Head(nn.Module):  # the last stage's module must return the logits
        def __init__(self, s: Stage) -> None:
            super().__init__()
            self.s = s

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.s.logits(self.s(h))

    module = Head(stage) if world.last_stage else stage
    pipe = PipelineStage(module, world.stage, world.pp, torch.device("cpu"),
                         group=world.pp_group)
    schedule = ScheduleGPipe(pipe, n_microbatches=world.micro_batch_count, loss_fn=_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    return {"stage": stage, "opt": opt, "schedule": schedule}, stage.copy()


def pipelining_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> None:
    stage, opt, schedule = state["stage"], state["opt"], state["schedule"]
    opt.zero_grad()
    x, y = world.shard(tokens), world.shard(targets)
    if world.first_stage:
        schedule.step(x)
    elif world.last_stage:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()
    _dp_all_reduce(world, stage)
    _embedding_all_reduce(world, stage.copy())
    opt.step()


# ---- DDP and FSDP2: every rank a replica (or a shard) of the whole tied model ----------------

def ddp_setup(world: World) -> tuple[Any, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TinyGPT(), process_group=world.dp_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return {"model": model, "opt": opt}, model.module.wte.weight


def ddp_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    model, opt = state["model"], state["opt"]
    opt.zero_grad()
    pairs = list(zip(world.micro_batches(tokens), world.micro_batches(targets)))
    for i, (x, y) in enumerate(pairs):
        if i < len(pairs) - 1:
            with model.no_sync():  # accumulate locally; the last backward all-reduces
                torch.autograd.backward(_loss(model(x), y) / len(pairs))
        else:
            torch.autograd.backward(_loss(model(x), y) / len(pairs))
    opt.step()


def fsdp2_setup(world: World) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = TinyGPT()
    mesh = DeviceMesh.from_group(world.dp_group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds wte and lm_head: one tied DTensor
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return {"model": model, "opt": opt}, model.wte.weight


def fsdp2_step(world: World, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    model, opt = state["model"], state["opt"]
    opt.zero_grad()
    pairs = list(zip(world.micro_batches(tokens), world.micro_batches(targets)))
    for i, (x, y) in enumerate(pairs):
        model.set_requires_gradient_sync(i == len(pairs) - 1)
        torch.autograd.backward(_loss(model(x), y) / len(pairs))
    opt.step()
