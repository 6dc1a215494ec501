"""The distributed kind's call: one batch through a user's distributed step on every layout.

Runs where the target runs (the worker, or this process for a built-in) and imports torch.
For each layout the target supports: the reference's components for that split of the batch
(:mod:`kinds.distributed.reference`), the step on every rank of that layout's world
(:mod:`kinds.distributed.launch`), and the three checks (:mod:`kinds.distributed.judge`).
What it hands back is plain data: the first wrong copy's gradient (else rank 0's) as ``dE``,
the reference's two paths as evidence, and one finding per invariant.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tyingspec._src.core.adapters import AdapterError, Returned, model_batch
from tyingspec._src.core.findings import Finding
from tyingspec._src.core.process_state import torch_state_kept
from tyingspec._src.core.tolerance import least_precise, row_tolerance
from tyingspec._src.kinds.distributed import judge
from tyingspec._src.kinds.distributed.launch import call_budget, run_case
from tyingspec._src.kinds.distributed.reference import build_reference, reference, tied
from tyingspec._src.kinds.distributed.target import DistributedTarget, place

#: The world sizes a layout may ask for (the machine the zoo runs on has 2 cores).
MAX_RANKS = 8


def as_target(spec: str, fn: Any) -> DistributedTarget:
    if isinstance(fn, DistributedTarget):
        return fn
    missing = [a for a in ("reference", "embedding", "setup", "step") if not hasattr(fn, a)]
    if missing:
        raise AdapterError(spec, "is not a distributed target", expected="a "
                           "tyingspec.DistributedTarget(reference, embedding, setup, step, "
                           "layouts)", got=f"{type(fn).__name__} without {', '.join(missing)}")
    return fn  # type: ignore[no-any-return]


def _layouts(spec: str, target: DistributedTarget) -> list[tuple[int, int]]:
    out = []
    for layout in target.layouts:
        try:
            pp, dp = (int(v) for v in layout)
        except (TypeError, ValueError):
            raise AdapterError(spec, "a layout is not (pp, dp)", key="layouts",
                               expected="pairs of positive integers",
                               got=repr(layout)) from None
        if pp < 1 or dp < 1 or pp * dp < 2 or pp * dp > MAX_RANKS:
            raise AdapterError(spec, "a layout's world size is out of range", key="layouts",
                               expected=f"pp x dp between 2 and {MAX_RANKS} ranks",
                               got=f"pp={pp} x dp={dp}")
        if target.batch_size % (dp * target.micro_batches):
            raise AdapterError(spec, "the batch does not split into the layout's replicas and "
                               "micro-batches", key="batch_size",
                               expected=f"a multiple of dp x micro_batches = "
                                        f"{dp * target.micro_batches}",
                               got=f"batch_size {target.batch_size} (pp={pp} x dp={dp})")
        out.append((pp, dp))
    if not out:
        raise AdapterError(spec, "declares no layout", key="layouts",
                           expected="at least one (pp, dp)", got="none")
    return out


def call_distributed(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the target (``inputs["mode"] == "describe"``) or observe it on a batch; the
    process's torch state is as it was afterwards."""
    with torch_state_kept():
        return _call(spec, fn, inputs)


def _call(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    started = time.monotonic()
    torch.set_num_threads(1)
    target = as_target(spec, fn)
    seed = int(inputs.get("seed", 0))
    layouts = _layouts(spec, target)
    model = build_reference(spec, target, seed)
    E = tied(spec, model, target.embedding)
    V, d = (int(n) for n in E.shape)
    tie = {"vocab": V, "width": d, "batch_size": int(target.batch_size),
           "seq_len": int(target.seq_len), "layouts": [list(x) for x in layouts]}
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), "float64", evidence={"tie": tie})
    B = int(target.batch_size)
    t2, y2 = model_batch(spec, inputs, B, V)
    deadline = started + 0.9 * call_budget()
    verdicts: dict[str, list[tuple[str, judge.Verdict]]] = {c: [] for c in judge.CHECKS}
    shown: np.ndarray | None = None
    evidence: dict[str, Any] = {}
    dtypes: list[str] = []
    for pp, dp in layouts:
        where = f"pp={pp} x dp={dp}"
        ref = reference(spec, target, seed, t2, y2, dp, target.micro_batches)
        parts = ref.components
        answers = run_case(target, spec, (pp, dp), target.micro_batches, seed, t2, y2,
                           deadline)
        expected = {s * dp + r for r in range(dp) for s in (0, pp - 1)}
        for rank in sorted(expected):
            if not answers[rank]["has_copy"]:
                raise AdapterError(spec, f"{place(rank, dp)} has no copy of the tied matrix "
                                   f"({where})", expected="setup to return its Parameter "
                                   "(the first and last stage of every replica hold one)",
                                   got="None")
        copies = {r: a for r, a in enumerate(answers) if a["has_copy"]}
        dtypes += [a["dtype"] for a in copies.values()]
        for r, a in copies.items():
            if a["start"].shape != (V, d):
                raise AdapterError(spec, f"{place(r, dp)}'s copy has the wrong shape ({where})",
                                   expected=f"[{V}, {d}] (the reference's {target.embedding})",
                                   got=f"{list(a['start'].shape)}")
        start = judge.start_check({r: a["start"] for r, a in copies.items()}, ref.E0, dp)
        if isinstance(start, str):
            raise AdapterError(spec, f"setup does not build the reference's tied matrix "
                               f"({where})", expected="the same initialisation", got=start)
        verdicts[judge.CHECK_START].append((where, start))
        grads = {r: np.zeros((V, d)) if a["grad"] is None else a["grad"]
                 for r, a in copies.items()}
        bound = judge.terms(parts, t2.size)
        tol = row_tolerance(bound, least_precise(*dtypes))
        grad, first = judge.gradient_check(grads, parts, tol, pp, dp)
        no_grad = [r for r, a in copies.items() if not a["has_grad"]]
        if no_grad and grad.label is not None:
            grad = judge.Verdict(grad.label, grad.detail + "; " + ", ".join(
                place(r, dp) for r in no_grad) + " had no .grad at all")
        verdicts[judge.CHECK_GRAD].append((where, grad))
        verdicts[judge.CHECK_AFTER].append((where, judge.after_check(
            {r: a["after"] for r, a in copies.items()}, dp, grad)))
        if shown is None or (first is not None and not evidence.get("wrong")):
            pick = first if first is not None else min(copies)
            shown = grads[pick]
            evidence = {"dE_in": ref.path("input"), "dE_out": ref.path("output"),
                        "per_position": ref.per_position, "tokens": ref.tokens,
                        "loss": ref.loss, "padding_idx": ref.padding_idx,
                        "bound_rows": bound.rows, "bound_k": bound.k,
                        "shown": f"{place(pick, dp)} on {where}", "wrong": first is not None}
    names = ", ".join(f"pp={pp} x dp={dp}" for pp, dp in layouts)
    findings: tuple[Finding, ...] = (
        judge.combine(judge.CHECK_START, judge.INV_START, verdicts[judge.CHECK_START],
                      f"every copy equals the reference's E ({names})"),
        judge.combine(judge.CHECK_GRAD, judge.INV_GRAD, verdicts[judge.CHECK_GRAD],
                      f"every copy holds both paths of every micro-batch and replica ({names})"),
        judge.combine(judge.CHECK_AFTER, judge.INV_AFTER, verdicts[judge.CHECK_AFTER],
                      f"every copy equal after the step ({names})"),
    )
    assert shown is not None
    evidence["tie"] = tie
    return Returned(shown, (), least_precise(*dtypes), evidence=evidence, findings=findings)
