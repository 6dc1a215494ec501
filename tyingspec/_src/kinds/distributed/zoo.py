"""The distributed kind's built-in targets: correct training stacks and one bug per label.

Each entry is a :class:`~kinds.distributed.target.DistributedTarget` over the tiny tied GPT
of :mod:`kinds.distributed.models`, whose functions are named here lazily: importing this
module (listing the built-ins) imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tyingspec._src.kinds.distributed.target import DistributedTarget

__all__ = ["DISTRIBUTED_BUILTINS", "DistributedBuiltin"]


@dataclass(frozen=True)
class DistributedBuiltin:
    """One built-in: its name, its attribute here, what it breaks, the label a check reaches."""

    name: str
    attr: str
    description: str
    breaks: str | None
    expected: str


def _lazy(name: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        models = importlib.import_module("tyingspec._src.kinds.distributed.models")
        return getattr(models, name)(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _target(setup: str, step: str, layouts: tuple[tuple[int, int], ...]) -> DistributedTarget:
    # the default micro-batch counts (3 or 4) and batch (24 x 6): only the layouts are chosen
    return DistributedTarget(reference=_lazy("reference"), embedding="wte.weight",
                             setup=_lazy(setup), step=_lazy(step), layouts=layouts)


PP2 = ((2, 1),)
DP2 = ((2, 2),)
gpt_pp2 = _target("pipeline_setup", "pipeline_step", PP2)
gpt_pp2_dp2 = _target("pipeline_setup", "pipeline_step", DP2)
gpt_pp3 = _target("pipeline_setup", "pipeline_step", ((3, 1),))
gpt_pipelining = _target("pipelining_setup", "pipelining_step", PP2)
gpt_ddp = _target("ddp_setup", "ddp_step", ((1, 2),))
gpt_fsdp2 = _target("fsdp2_setup", "fsdp2_step", ((1, 2),))
gpt_pp2_not_synced = _target("pipeline_setup", "not_synced_step", PP2)
gpt_pp2_synced_early = _target("pipeline_setup", "synced_early_step", PP2)
gpt_pp2_late_micro = _target("pipeline_setup", "late_micro_step", PP2)
gpt_pp2_not_zeroed = _target("pipeline_setup", "not_zeroed_step", PP2)
gpt_pp2_dp2_partial_shards = _target("pipeline_setup", "partial_shards_step", DP2)
gpt_pp2_dp2_world_group = _target("pipeline_setup", "world_group_step", DP2)
gpt_pp2_averaged = _target("pipeline_setup", "averaged_step", PP2)
gpt_pp2_init_diverge = _target("init_diverge_setup", "pipeline_step", PP2)
gpt_pp2_steps_differ = _target("steps_differ_setup", "pipeline_step", PP2)

DISTRIBUTED_BUILTINS: dict[str, DistributedBuiltin] = {b.name: b for b in [
    DistributedBuiltin("gpt-pp2", "gpt_pp2", "2-stage tied GPT (Megatron-style GPipe), the "
                       "embedding-group all-reduce after the DP all-reduce", None, "correct"),
    DistributedBuiltin("gpt-pp2-dp2", "gpt_pp2_dp2", "the same pipeline on pp=2 x dp=2",
                       None, "correct"),
    DistributedBuiltin("gpt-pp3", "gpt_pp3", "the same pipeline on 3 stages: the middle one "
                       "holds blocks and no copy", None, "correct"),
    DistributedBuiltin("gpt-pipelining", "gpt_pipelining", "2 stages on torch.distributed."
                       "pipelining (ScheduleGPipe), then the embedding-group all-reduce", None,
                       "correct"),
    DistributedBuiltin("gpt-ddp", "gpt_ddp", "DDP over the tied GPT (no_sync micro-batches)",
                       None, "correct"),
    DistributedBuiltin("gpt-fsdp2", "gpt_fsdp2", "FSDP2 fully_shard over the tied GPT "
                       "(blocks, then the root holding the tie)", None, "correct"),
    DistributedBuiltin("gpt-pp2-not-synced", "gpt_pp2_not_synced", "copies duplicated per "
                       "stage, never all-reduced (piper #13, PR #25)", "SUM",
                       "replica_not_synced"),
    DistributedBuiltin("gpt-pp2-synced-early", "gpt_pp2_synced_early", "the head's deferred "
                       "wgrad added after the embedding all-reduce (Megatron-LM #1012, #656)",
                       "SUM", "replica_synced_early"),
    DistributedBuiltin("gpt-pp2-late-micro", "gpt_pp2_late_micro", "the head's wgrad deferred "
                       "past the embedding all-reduce from the third micro-batch on (right "
                       "with two micro-batches)", "SUM", "replica_synced_early"),
    DistributedBuiltin("gpt-pp2-not-zeroed", "gpt_pp2_not_zeroed", "the pipeline step "
                       "without its zero_grad: right on a fresh setup, stale from the second "
                       "step on", "FRESH", "gradient_not_zeroed"),
    DistributedBuiltin("gpt-pp2-dp2-world-group", "gpt_pp2_dp2_world_group", "the copies "
                       "all-reduced over the world group, not the embedding group (right "
                       "where the two coincide, pp=2 x dp=1)", "SCALE", "path_scaled"),
    DistributedBuiltin("gpt-pp2-dp2-partial-shards", "gpt_pp2_dp2_partial_shards", "DP "
                       "reduce-scatter before the PP embedding all-reduce (Megatron-LM #844)",
                       "SUM", "replica_partial_shards"),
    DistributedBuiltin("gpt-pp2-averaged", "gpt_pp2_averaged", "the embedding group averages "
                       "the copies' gradients instead of summing them", "SCALE",
                       "replicas_averaged"),
    DistributedBuiltin("gpt-pp2-init-diverge", "gpt_pp2_init_diverge", "the last stage's "
                       "copy keeps its zero init: initialize_word_embeddings' all-reduce "
                       "skipped", "ID", "replicas_diverge"),
    DistributedBuiltin("gpt-pp2-steps-differ", "gpt_pp2_steps_differ", "the last stage steps "
                       "its copy with another learning rate (an output-layer lr multiplier)",
                       "ID", "replicas_diverge"),
]}
