"""The distributed kind's call: one batch through a user's distributed step on every layout.

Runs where the target runs (the worker, or this process for a built-in) and imports torch.
Each case draws, from its seed, how many steps run on one setup (2 to 4) and, for each layout,
how many micro-batches each step takes (one of the target's counts that split that layout's
share of the batch); the first step's batch is the case's, each later one is drawn.  For each
layout the target supports, in order: the reference's components for that split of each step's
batch (:mod:`kinds.distributed.reference`), the steps on every rank of that layout's world
(:mod:`kinds.distributed.launch`), and the three checks, step by step
(:mod:`kinds.distributed.judge`).  The first layout with a wrong copy decides: the layouts after
it are not run.  What it hands back is plain data: the first wrong copy's gradient (else rank
0's on the first step) as ``dE``, that step's reference paths as evidence, and one finding per
invariant.
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
#: How many steps a case runs on one setup, drawn from its seed: at least two, so that a
#: gradient the step never zeroes is seen carrying the step before.
STEPS = (2, 3, 4)


def as_target(spec: str, fn: Any) -> DistributedTarget:
    if isinstance(fn, DistributedTarget):
        return fn
    missing = [a for a in ("reference", "embedding", "setup", "step") if not hasattr(fn, a)]
    if missing:
        raise AdapterError(spec, "is not a distributed target", expected="a "
                           "tyingspec.DistributedTarget(reference, embedding, setup, step, "
                           "layouts)", got=f"{type(fn).__name__} without {', '.join(missing)}")
    return fn  # type: ignore[no-any-return]


def _micro_counts(spec: str, target: DistributedTarget) -> tuple[int, ...]:
    """The micro-batch counts a case may draw: the target's count, or its counts."""
    given: Any = target.micro_batches
    try:
        counts = (given,) if isinstance(given, int) else tuple(given)
    except TypeError:
        counts = ()
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                         for c in counts):
        raise AdapterError(spec, "micro_batches is not a count or a list of counts",
                           key="micro_batches", expected="positive integers, e.g. (3, 4)",
                           got=repr(given))
    return tuple(counts)


def _layouts(spec: str, target: DistributedTarget, counts: tuple[int, ...]
             ) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
    """Each layout with the micro-batch counts its share of the batch splits into."""
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
        fits = tuple(m for m in counts if target.batch_size % (dp * m) == 0)
        if not fits:
            raise AdapterError(spec, "the batch does not split into the layout's replicas and "
                               "micro-batches", key="batch_size",
                               expected="a multiple of dp x micro_batches = " + " or ".join(
                                   str(dp * m) for m in counts),
                               got=f"batch_size {target.batch_size} (pp={pp} x dp={dp})")
        out.append(((pp, dp), fits))
    if not out:
        raise AdapterError(spec, "declares no layout", key="layouts",
                           expected="at least one (pp, dp)", got="none")
    return out


def _draws(seed: int, fits: list[tuple[int, ...]], tokens: np.ndarray, targets: np.ndarray,
           V: int) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
    """The case's micro-batch count on each layout (one of the counts its share splits into)
    and its steps' batches: the case's own first, then one drawn per further step (another
    batch, so that a gradient carried from the step before is not a multiple of this
    step's)."""
    rng = np.random.default_rng([seed, 50])
    steps = int(rng.choice(STEPS))
    micro = [int(rng.choice(f)) for f in fits]
    batches = [(tokens, targets)]
    for _ in range(steps - 1):
        batches.append((rng.integers(0, V, size=tokens.shape, dtype=np.int64),
                        rng.integers(0, V, size=targets.shape, dtype=np.int64)))
    return micro, batches


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
    planned = _layouts(spec, target, _micro_counts(spec, target))
    layouts = [layout for layout, _ in planned]
    model = build_reference(spec, target, seed)
    E = tied(spec, model, target.embedding)
    V, d = (int(n) for n in E.shape)
    tie = {"vocab": V, "width": d, "batch_size": int(target.batch_size),
           "seq_len": int(target.seq_len), "layouts": [list(x) for x in layouts]}
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), "float64", evidence={"tie": tie})
    B = int(target.batch_size)
    t2, y2 = model_batch(spec, inputs, B, V)
    micros, batches = _draws(seed, [fits for _, fits in planned], t2, y2, V)
    deadline = started + 0.9 * call_budget()
    verdicts: dict[str, list[tuple[str, judge.Verdict]]] = {c: [] for c in judge.CHECKS}
    shown: np.ndarray | None = None
    evidence: dict[str, Any] = {}
    dtypes: list[str] = []
    run: list[str] = []
    for (pp, dp), micro in zip(layouts, micros):
        run.append(f"pp={pp} x dp={dp} ({micro} micro-batches)")
        where = f"pp={pp} x dp={dp}"
        refs = [reference(spec, target, seed, t, y, dp, micro, i)
                for i, (t, y) in enumerate(batches)]
        answers = run_case(target, spec, (pp, dp), micro, seed, batches, deadline)
        copies = _copies(spec, answers, pp, dp, (V, d), target.embedding)
        dtypes += [a["dtype"] for a in copies.values()]
        start = judge.start_check({r: a["start"] for r, a in copies.items()}, refs[0].E0, dp)
        if isinstance(start, str):
            raise AdapterError(spec, f"setup does not build the reference's tied matrix "
                               f"({where})", expected="the same initialisation", got=start)
        verdicts[judge.CHECK_START].append((where, start))
        before: dict[int, np.ndarray] | None = None
        for i, ref in enumerate(refs):
            at = f"{where}, step {i + 1} of {len(refs)}, {micro} micro-batches"
            grads = {r: np.zeros((V, d)) if a["grads"][i] is None else a["grads"][i]
                     for r, a in copies.items()}
            bound = judge.terms(ref.components, t2.size)
            tol = row_tolerance(bound, least_precise(*dtypes))
            grad, first = judge.gradient_check(grads, ref.components, tol, pp, dp, before)
            no_grad = [r for r, a in copies.items() if not a["has_grad"][i]]
            if no_grad and grad.label is not None:
                grad = judge.Verdict(grad.label, grad.detail + "; " + ", ".join(
                    place(r, dp) for r in no_grad) + " had no .grad at all")
            verdicts[judge.CHECK_GRAD].append((at, grad))
            verdicts[judge.CHECK_AFTER].append((at, judge.after_check(
                {r: a["afters"][i] for r, a in copies.items()}, dp, grad)))
            if shown is None or (first is not None and not evidence.get("wrong")):
                pick = first if first is not None else min(copies)
                shown = grads[pick]
                evidence = {"dE_in": ref.path("input"), "dE_out": ref.path("output"),
                            "per_position": ref.per_position, "tokens": ref.tokens,
                            "loss": ref.loss, "padding_idx": ref.padding_idx,
                            "bound_rows": bound.rows, "bound_k": bound.k,
                            "shown": f"{place(pick, dp)} on {at}", "wrong": first is not None}
            before = grads
        if any(v.label is not None for vs in verdicts.values() for _, v in vs):
            break  # this layout decides the verdict: the ones after it would only add cost
    names = ", ".join(run)
    steps = f"{len(batches)} steps on one setup"
    findings: tuple[Finding, ...] = (
        judge.combine(judge.CHECK_START, judge.INV_START, verdicts[judge.CHECK_START],
                      f"every copy equals the reference's E ({names})"),
        judge.combine(judge.CHECK_GRAD, judge.INV_GRAD, verdicts[judge.CHECK_GRAD],
                      f"every copy holds both paths of every micro-batch and replica, at "
                      f"every step ({names}; {steps})"),
        judge.combine(judge.CHECK_AFTER, judge.INV_AFTER, verdicts[judge.CHECK_AFTER],
                      f"every copy equal after every step ({names}; {steps})"),
    )
    assert shown is not None
    evidence["tie"] = tie
    return Returned(shown, (), least_precise(*dtypes), evidence=evidence, findings=findings)


def _copies(spec: str, answers: list[dict[str, Any]], pp: int, dp: int, shape: tuple[int, int],
            name: str) -> dict[int, dict[str, Any]]:
    """The answers of the ranks that hold a copy, after checking that the first and last stage
    of every replica do and that every copy has the reference's shape."""
    where = f"pp={pp} x dp={dp}"
    for rank in sorted({s * dp + r for r in range(dp) for s in (0, pp - 1)}):
        if not answers[rank]["has_copy"]:
            raise AdapterError(spec, f"{place(rank, dp)} has no copy of the tied matrix "
                               f"({where})", expected="setup to return its Parameter "
                               "(the first and last stage of every replica hold one)",
                               got="None")
    copies = {r: a for r, a in enumerate(answers) if a["has_copy"]}
    for r, a in copies.items():
        if a["start"].shape != shape:
            raise AdapterError(spec, f"{place(r, dp)}'s copy has the wrong shape ({where})",
                               expected=f"[{shape[0]}, {shape[1]}] (the reference's {name})",
                               got=f"{list(a['start'].shape)}")
    return copies
