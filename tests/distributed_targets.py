"""Distributed targets written as users write them, right and wrong, for
``tests/kinds/distributed/test_distributed_steps.py``, and what the tests of the kind share to
see that nothing is left behind (processes, listening ports).

The targets are the quick start's pipeline (``examples/distributed/pipeline.py``: a tied model
cut into any number of stages, each replicated over ``dp`` ranks) with momentum SGD, and one
change each to its step.  They are the user's code, not tyingspec's zoo
(``kinds/distributed/models.py``), so the tests judge code tyingspec did not write.  Every
function is module level: the ranks are forked, and the CLI test's worker imports this module
by name.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tyingspec import DistributedTarget

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is the checkout's, not installed

from examples.distributed import pipeline as example  # noqa: E402

V, D = example.V, example.D
Model = example.Model


def setup(world: Any) -> tuple[dict[str, Any], Any]:
    """The example's setup, with an optimizer that keeps state across steps and a count of
    the step's calls."""
    state, copy = example.setup(world)
    state.update(copy=copy, calls=[0],
                 opt=torch.optim.SGD(state["stage"].parameters(), lr=0.1, momentum=0.9))
    return state, copy


def _grad(copy: torch.Tensor) -> torch.Tensor:
    if copy.grad is None:
        copy.grad = torch.zeros_like(copy)
    return copy.grad


def _sum_copies(world: Any, state: dict[str, Any]) -> None:
    if state["copy"] is not None:
        dist.all_reduce(_grad(state["copy"]), group=world.embedding_group)


def _sum_once(world: Any, state: dict[str, Any]) -> None:
    """The copies summed on the step's first call only (a sync set up lazily, then
    skipped)."""
    if state["calls"][0] == 0:
        _sum_copies(world, state)


def _sum_over_world(world: Any, state: dict[str, Any]) -> None:
    """The copies summed over the world group (``group=`` left out): every rank joins, a
    stage without a copy with zeros."""
    copy = state["copy"]
    dist.all_reduce(_grad(copy) if copy is not None else torch.zeros(V, D))


def _train(world: Any, state: dict[str, Any], tokens: torch.Tensor, targets: torch.Tensor, *,
           zero: bool = True, sync: Callable[[Any, dict[str, Any]], None] = _sum_copies,
           defer_from: int | None = None) -> None:
    """The example's step with one thing changed: no ``zero_grad``, another ``sync`` of the
    copies, or the head's weight gradient deferred from micro-batch ``defer_from`` on (each
    micro-batch's gradient of the head copy kept aside by a hook, added after the sync)."""
    if zero:
        state["opt"].zero_grad()
    kept: list[torch.Tensor] = []
    hook = None
    if defer_from is not None and world.last_stage:
        calls = [0]  # the head copy's gradients so far: one per micro-batch

        def defer(g: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] <= defer_from:
                return g
            kept.append(g.clone())
            return torch.zeros_like(g)

        hook = state["copy"].register_hook(defer)
    try:
        example.forward_backward(world, state["stage"], tokens, targets)
    finally:
        if hook is not None:
            hook.remove()
    example.average_replicas(world, state["stage"])
    sync(world, state)
    for g in kept:  # finish the deferred wgrad: after the sum, too late
        _grad(state["copy"]).add_(g)
    state["calls"][0] += 1
    state["opt"].step()


def step(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    _train(world, state, tokens, targets)


def never_zeroed_step(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    """Without its ``zero_grad``: right on a fresh setup only."""
    _train(world, state, tokens, targets, zero=False)


def second_step_unsynced(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    """The second step's gradients are each stage's own path."""
    _train(world, state, tokens, targets, sync=_sum_once)


def world_group_step(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    """Right where the world is the embedding group (pp=2 x dp=1) only."""
    _train(world, state, tokens, targets, sync=_sum_over_world)


def late_head_step(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    """The head's weight gradient deferred past the sync from the third micro-batch on:
    right with two micro-batches."""
    _train(world, state, tokens, targets, defer_from=2)


def step_raises_on_rank_0(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    if world.rank == 0:
        raise KeyError("no batch today")
    step(world, state, tokens, targets)


def hang_step(world: Any, state: dict[str, Any], tokens: Any, targets: Any) -> None:
    if world.rank == 1:
        time.sleep(3600)
    step(world, state, tokens, targets)


def setup_raises(world: Any) -> tuple[dict[str, Any], Any]:
    if world.rank == 1:
        raise RuntimeError("no such stage in this build")
    return setup(world)


class BrokenForward(Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the reference cannot run this batch")


def target(step_fn: Any = step, **changes: Any) -> DistributedTarget:
    """A target over the example's model, with ``changes`` to its fields."""
    fields: dict[str, Any] = {"reference": Model, "embedding": "wte.weight", "setup": setup,
                              "step": step_fn}
    fields.update(changes)
    return DistributedTarget(**fields)


#: For the CLI: a step whose rank 1 hangs, on one small layout.
hangs = target(hang_step, layouts=((2, 1),))


# ---- nothing left behind ------------------------------------------------------------------

def listening() -> dict[str, int]:
    """Every listening TCP socket of this machine: its inode and its port."""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return ports


def marked(mark: str) -> list[int]:
    """The processes whose environment holds ``mark`` (a run's own, and what it started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if mark.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found
