"""Gradient accumulation: micro-batches of a sum loss add up to the whole batch."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from tyingspec._cases import Case, build, closed_form
from tyingspec._diagnosis import ArrayCheck, diagnose
from tyingspec._strategies import cases

from ._common import (
    Adapter,
    agree,
    concrete,
    judged_dtype,
    kernel_case,
    natural_scales,
    other_checks,
    run_model,
    seeded,
)
from ._core import PropertyFailure, register, require_power


def cuts(case: Case) -> list[tuple[int, int]]:
    """The micro-batches used for ``case``: 2 to 4 contiguous, non-empty slices of the batch."""
    rng = seeded(case, 0xACC)
    k = int(rng.integers(2, min(4, case.N) + 1))
    inner = np.sort(rng.choice(np.arange(1, case.N), size=k - 1, replace=False))
    edges = [0, *map(int, inner), case.N]
    return list(pairwise(edges))


@register("micro_batches_accumulate", "ACC", ("model", "kernel"), lambda: cases(min_len=2))
def micro_batches_accumulate(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """Splitting a batch into micro-batches and accumulating changes nothing.  Model: with the
    loss a mean over positions, N_i * grad(micro-batch i) summed over i equals N * grad(whole
    batch) for dE, dW, db and the loss (the sum loss is additive).  Kernel: the kernel is a sum
    over positions, so its outputs on the slices of (tokens, dx, h, g) add up to its output on
    the whole."""
    batch = build(case)
    paths = closed_form(batch)
    scales = natural_scales(batch)
    require_power(diagnose(paths.dE, paths, dtype=case.dtype, scale=scales["dE"]))
    pieces = cuts(case)
    mismatched: list[str] = []
    others: list[ArrayCheck] = []
    if kind == "kernel":
        k, _, _ = kernel_case(batch)
        whole, _ = k.call(spec, fn)
        parts = [k.call(spec, fn, tokens=k.tokens[a:z], dx=k.dx[a:z], h=k.h[a:z],
                        g=k.g[a:z])[0] for a, z in pieces]
        dtype = judged_dtype(case, whole, *parts)
        acc = np.sum([np.asarray(p, dtype=np.float64) for p in parts], axis=0)
        if not agree(acc, whole, dtype, paths.dE_in, paths.dE_out, scales["dE"], *parts).all():
            mismatched.append("dE")
        dE, acc_dE = whole, acc
    else:
        out = run_model(spec, fn, batch)
        outs = [run_model(spec, fn, batch, tokens=batch.tokens[a:z], targets=batch.targets[a:z])
                for a, z in pieces]
        sizes = [z - a for a, z in pieces]
        dtype = judged_dtype(case, out.dE, out.dW, *[o.dE for o in outs])
        names = ["loss", "dE", "dW"] + (["db"] if batch.b is not None else [])
        for name in names:
            scaled = [n * np.asarray(getattr(o, name), dtype=np.float64)
                      for n, o in zip(sizes, outs)]
            whole_scaled = case.N * np.asarray(getattr(out, name), dtype=np.float64)
            # each side is a sum-loss quantity: N times the mean-loss bound
            if not agree(np.sum(scaled, axis=0), whole_scaled, dtype, case.N * scales[name],
                         *scaled).all():
                mismatched.append(name)
        dE, others = out.dE, other_checks(out, paths, dtype, batch)
        acc_dE = np.sum([n * np.asarray(o.dE, dtype=np.float64) for n, o in zip(sizes, outs)],
                        axis=0) / case.N
    if mismatched:
        # Diagnose whichever side is wrong: the whole batch, else the accumulated micro-batches.
        diag = diagnose(dE, paths, dtype=dtype, others=others, scale=scales["dE"])
        if not diag.wrong:
            diag = diagnose(acc_dE, paths, dtype=dtype, scale=scales["dE"])
        raise PropertyFailure(
            "micro_batches_accumulate",
            f"accumulating {len(pieces)} micro-batches {pieces} differs from the whole batch "
            f"in {', '.join(mismatched)}", concrete(case, batch),
            diagnosis=diag,
            details="micro-batches as position slices [start, stop): "
                    + ", ".join(f"[{a}, {z})" for a, z in pieces))
