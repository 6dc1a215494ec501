"""A linear-ce case's own draws: what its options (``Case.ce``) add to the batch
:func:`core.cases.build` makes from its seed (ignored targets at a drawn ``ignore_index``,
class weights, an upstream gradient), and E's scale at another width (``--shape``).

The table entry (:mod:`kinds.linear_ce.spec`) hands these to core as ``KindSpec.draws`` and
``KindSpec.e_scale_at``, so core builds a linear-ce batch without naming the kind.  Each draw
has its own stream from the case's seed, so the other arrays are those of the same case
without options.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from tyingspec._src.core.cases import Batch, Case

IGNORE_INDEX = -100
#: The kernel options, as Liger's constructor names them (plus logit_scale).
OPTION_NAMES = ("logit_scale", "softcap", "label_smoothing", "lse_square_scale", "ignore_index",
                "reduction", "ce_weight")
REDUCTION_VALUES: tuple[str, ...] = ("mean", "sum", "none")
#: Tokens per chunk when a case ignores a whole chunk (a fused kernel's block is rarely 7).
CHUNK = 7
#: Cases whose point is their length (a kernel's dE past two of its blocks): ``--shape``
#: gives them its V and d and keeps their N.
LENGTH_CASES = ("ce-long",)


def ce_options(text: str) -> dict[str, str]:
    """``"logit_scale=0.0625,ignored=0.25"`` as a dict (values as written)."""
    out: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"linear-ce option {part!r}: expected key=value")
        out[key] = value
    return out


def ce_e_scale(case: Case, d: int) -> float | None:
    """E's scale for a linear-ce case at width ``d`` that keeps the logits' spread the case
    is drawn for (its ``logits=`` part: ``h ~ E[token]``, so the largest logits are about
    ``d * e_scale**2``), or None for a case that names none.  ``--shape`` keeps each case's
    power this way: at GPT-2's 0.02 a case drawn for logits near 1e4 (where a naive ``exp``
    overflows) or for a softcap's curved part would have logits near 0."""
    logits = ce_options(case.ce).get("logits")
    return None if logits is None else math.sqrt(float(logits) / max(d, 1))


def drawn_ignore_index(case: Case) -> int:
    """The case's ignore_index: as written (``ignore_index=-100``), a class of the vocabulary
    (``ignore_index=vocab``, as a pad token id is), or, unset, either, from the case's seed.
    Drawn so that a kernel that hard-codes -100 is caught; never another negative value, so
    that every replayed target is in [0, V) or -100 (what ``tyingspec check --targets``
    takes).  Its own stream: the case's other draws are those of the same case without it."""
    value = ce_options(case.ce).get("ignore_index")
    rng = np.random.default_rng([case.seed, 8])
    if value is None:
        value = "-100" if rng.random() < 0.5 else "vocab"
    return int(rng.integers(case.V)) if value == "vocab" else int(value)


def with_ce(batch: Batch, case: Case, *, explicit: bool) -> Batch:
    """The batch's linear-ce draws: ignored targets (at the drawn ignore_index), class weights,
    grad_output (their own stream from the case seed, so the other arrays are those of the
    same case without them).  The batch's ``ce`` carries the ignore_index it was drawn with."""
    opts = ce_options(case.ce)
    rng = np.random.default_rng([case.seed, 7])
    targets = batch.targets
    N, V = targets.shape[0], batch.E.shape[0]
    ce = case.ce
    if "ignored" in opts or "ignore_index" in opts:
        ignore_index = drawn_ignore_index(case)
        ce = ",".join([f"{k}={v}" for k, v in opts.items() if k != "ignore_index"]
                      + [f"ignore_index={ignore_index}"])
    if "ignored" in opts and not explicit:
        fraction = float(opts["ignored"])
        targets = targets.copy()
        ignored = np.zeros(N, dtype=bool)
        if fraction > 0:
            ignored[:min(CHUNK, N)] = True  # a whole chunk of ignored tokens
            ignored |= rng.random(N) < fraction
        if fraction >= 1:
            ignored[:] = True
        targets[ignored] = ignore_index
    if opts.get("target") == "same" and not explicit:
        targets = np.full_like(targets, targets[0])
    dt = batch.E.dtype
    weight = np.asarray(rng.uniform(0.5, 2.0, size=V), dtype=dt) \
        if "ce_weight" in opts else None
    grad_output = np.asarray(rng.normal(size=N) + 1.5, dtype=dt) \
        if opts.get("reduction") == "none" else None
    return replace(batch, targets=targets, ce=ce, ce_weight=weight,
                   grad_output=grad_output)


def draws(batch: Batch, case: Case) -> Batch:
    """``KindSpec.draws``: the case's draws on the batch its seed made; an explicit batch (a
    replay's, a shrunk one) keeps its targets as given."""
    if not case.ce:
        return batch
    return with_ce(batch, case, explicit=case.targets is not None)


def e_scale_at(case: Case, d: int) -> float | None:
    """``KindSpec.e_scale_at``: E's scale for ``case`` at width ``d`` (see :func:`ce_e_scale`);
    None: the default one."""
    return ce_e_scale(case, d) if case.ce else None
