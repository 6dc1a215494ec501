"""The largest batch a torch check runs: the model's whole context, within a budget.

A check runs a few hundred forward and backward passes over four cases (the forward check's
directional differences are most of them), so the batch it can afford is the one whose pass
costs at most :data:`BUDGET_SECONDS` over :data:`PASSES`.  It is measured on the model itself,
in the worker, before the first case: one forward and backward at the whole context and the
batch of :func:`kinds.torch.setting.fitted_shape`, halving the sequence while a pass costs
more (or while the forward raises at that length: a position table shorter than the context
the model declares).  What was cut, and why, is a note of the report.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

import torch

from tyingspec._src.kinds.torch.batch import TorchBatch
from tyingspec._src.kinds.torch.discover import Tie, loss_function
from tyingspec._src.kinds.torch.setting import fitted_shape
from tyingspec._src.kinds.torch.target import TorchTarget


class BuildLike(Protocol):
    """What the budget reads of a ``kinds.torch.adapter.Build`` (named here, not imported: the
    adapter imports this module)."""

    target: TorchTarget

    def fresh(self) -> torch.nn.Module: ...

#: Seconds of model passes one check may spend, and about how many passes it takes.
BUDGET_SECONDS = 60.0
PASSES = 400
#: The most tokens one batch holds by default (``--shape`` or ``TorchTarget(seq_len=,
#: batch_size=)`` go further).
MAX_TOKENS = 4096


def _pass_seconds(build: BuildLike, tie: Tie, B: int, T: int) -> float:
    """One forward and backward of a fresh model at ``B`` x ``T`` (raises what it raises)."""
    model = build.fresh()
    ids = torch.arange(B * T).reshape(B, T) % tie.vocab
    run = loss_function(build.target, tie)
    t0 = time.perf_counter()
    loss = run(model, TorchBatch(ids, ids, ignore_index=tie.ignore_index or -100))
    loss.backward()  # type: ignore[no-untyped-call]
    return time.perf_counter() - t0


def fitted(build: BuildLike, tie: Tie) -> tuple[Tie, str]:
    """``tie`` with the batch shape a check runs (``batch_size`` x ``seq_len``), and the
    report's note on it."""
    target = build.target
    context = tie.seq_len
    B, T = fitted_shape(context, MAX_TOKENS, target.batch_size)
    where = f"context {tie.context} positions" if tie.context else \
        "no context length declared"
    if target.seq_len:
        return replace(tie, batch_size=B, seq_len=T), \
            f"{B} x {T} tokens (the target's seq_len{', batch_size' * bool(target.batch_size)})"
    per_pass = BUDGET_SECONDS / PASSES
    cut = ""
    while True:
        try:
            cost = _pass_seconds(build, tie, B, T)
        except Exception as exc:  # noqa: BLE001  (a length the model cannot take: shorter)
            if T <= 2:
                break
            cut = (f"the forward raised at T = {T} ({type(exc).__name__}: "
                   f"{str(exc)[:120]})")
            T = max(2, T // 2)
            continue
        if cost <= per_pass or T <= 2:
            if cost > per_pass:
                cut = cut or f"one pass costs {cost:.2g} s at the smallest batch"
            break
        cut = f"one pass at T = {T} cost {cost:.2g} s, over the budget's {per_pass:.2g} s"
        T = max(2, T // 2)
        B = fitted_shape(T, MAX_TOKENS, target.batch_size)[0]
    note = f"{where}; batches up to {B} x {T} = {B * T} tokens"
    if cut:
        note += (f" ({cut}: set TorchTarget(seq_len=...) or --shape to check longer "
                 "sequences)")
    elif tie.context and T < tie.context:
        note += f" (cut to {MAX_TOKENS} tokens a batch; --shape goes further)"
    return replace(tie, batch_size=B, seq_len=T), note
