"""Gradient accumulation: micro-batches of a sum loss add up to the whole batch."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import (
    Target,
    agree,
    batch_for,
    call,
    judge,
    precision_for,
    reference,
)

from ._common import seeded
from ._core import PropertyFailure, register, require_power


def cuts(case: Case) -> list[tuple[int, int]]:
    """The micro-batches used for ``case``: 2 to 4 contiguous, non-empty slices of the batch."""
    rng = seeded(case, 0xACC)
    k = int(rng.integers(2, min(4, case.N) + 1))
    inner = np.sort(rng.choice(np.arange(1, case.N), size=k - 1, replace=False))
    edges = [0, *map(int, inner), case.N]
    return list(pairwise(edges))


@register("micro_batches_accumulate", "ACC", lambda: cases(min_len=2))
def micro_batches_accumulate(target: Target, case: Case) -> None:
    """Splitting a batch into micro-batches and accumulating changes nothing.  Model: with the
    loss a mean over positions, N_i * grad(micro-batch i) summed over i equals N * grad(whole
    batch) for dE, dW, db and the loss (the sum loss is additive).  Kernel: the kernel is a sum
    over positions, so its outputs on the slices of (tokens, dx, h, g) add up to its output on
    the whole."""
    case, batch = batch_for(target, case)
    pieces = cuts(case)
    paths = reference(target, batch)
    whole = call(target, batch)
    precision = precision_for(target, whole)
    diag = judge(whole, paths, precision)
    require_power(diag)
    inputs = target.kind.inputs(batch)
    sliced = target.kind.sliced  # the inputs along the positions
    if target.kind.plain_sum:
        sizes = [1] * len(pieces)  # a kernel is a plain sum over positions
        scale = 1.0
    else:
        sizes = [z - a for a, z in pieces]
        scale = float(case.N)
    parts = [call(target, batch, **{k: inputs[k][a:z] for k in sliced}) for a, z in pieces]
    precision = precision_for(target, whole, *parts)
    names = ["dE"] if target.kind.plain_sum else \
        ["loss", "dE", "dW"] + (["db"] if batch.b is not None else [])
    mismatched = []
    for name in names:
        acc = np.sum([n * np.asarray(getattr(p, name), dtype=np.float64)
                      for n, p in zip(sizes, parts, strict=True)], axis=0)
        ref = scale * np.asarray(getattr(whole, name), dtype=np.float64)
        # each side is a sum of len(pieces) + 1 results, each within its own (scaled) bound
        if not agree(name, acc, ref, paths, precision, factor=2.0 * scale).all():
            mismatched.append(name)
    if mismatched:
        # Diagnose whichever side is wrong: the whole batch, else the accumulated micro-batches.
        if not diag.wrong:
            acc_dE = np.sum([n * np.asarray(p.dE, dtype=np.float64)
                             for n, p in zip(sizes, parts, strict=True)], axis=0) / scale
            from dataclasses import replace

            diag = judge(replace(whole, dE=acc_dE), paths, precision)
        raise PropertyFailure(
            "micro_batches_accumulate",
            f"accumulating {len(pieces)} micro-batches {pieces} differs from the whole batch "
            f"in {', '.join(mismatched)}", case,
            diagnosis=diag,
            details="micro-batches as position slices [start, stop): "
                    + ", ".join(f"[{a}, {z})" for a, z in pieces))
