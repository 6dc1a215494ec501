"""Relabelling the vocabulary: token ids are names, not semantics."""

from __future__ import annotations

from typing import Any

import numpy as np

from tyingspec._src.core.cases import Batch, Case
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

from ._common import rows_text, seeded
from ._core import PropertyFailure, register, require_power


def permutation(case: Case) -> np.ndarray:
    """The relabelling used for ``case``: token v becomes ``perm[v]``; never the identity."""
    perm = seeded(case, 0x9E1).permutation(case.V)
    if case.V > 1 and (perm == np.arange(case.V)).all():
        perm = np.roll(perm, 1)
    return perm


def _permute_rows(a: np.ndarray, perm: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    out[perm] = a  # row v moves to row perm[v]
    return out


def relabelled(target: Target, batch: Batch, perm: np.ndarray) -> dict[str, Any]:
    """The inputs of ``batch`` with every token id v renamed perm[v], for the target's kind."""
    inputs = target.kind.inputs(batch)
    if target.kind.plain_sum:  # a kernel's inputs: the positions' rows and logit columns
        g2 = np.empty_like(inputs["g"])
        g2[:, perm] = inputs["g"]  # logit column v becomes column perm[v]
        return {"tokens": perm[inputs["tokens"]], "g": g2}
    return {"E": _permute_rows(batch.E, perm),
            "b": None if batch.b is None else _permute_rows(batch.b, perm),
            "tokens": perm[batch.tokens], "targets": perm[batch.targets]}


@register("relabelling_permutes_rows", "PERM", lambda: cases(min_vocab=2))
def relabelling_permutes_rows(target: Target, case: Case) -> None:
    """Relabelling the vocabulary by a permutation p (row v of E and entry v of b move to p(v);
    tokens and targets t become p(t)) permutes the rows of dE the same way: dE'[p(v)] = dE[v].
    Both gradients come from the implementation under test; no row is special."""
    case, batch = batch_for(target, case)
    perm = permutation(case)
    paths = reference(target, batch)
    got = call(target, batch)
    precision = precision_for(target, got)
    diag = judge(got, paths, precision)
    require_power(diag)
    changes = relabelled(target, batch, perm)
    got2 = call(target, batch, **changes)
    back = np.asarray(got2.dE)[perm]  # row v of back is row perm[v] of the relabelled gradient
    precision = precision_for(target, got, got2)
    ok = agree("dE", back, got.dE, paths, precision).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        which = "original batch"
        if not diag.wrong:  # then the relabelled call is the wrong one
            diag = judge(got2, reference(target, batch, **changes), precision)
            which = "relabelled batch (relabelled ids)"
        raise PropertyFailure(
            "relabelling_permutes_rows",
            f"relabelling the vocabulary changed {bad.size} of {case.V} rows of dE "
            "beyond the permutation", case,
            diagnosis=diag,
            details=f"rows (original ids) that differ: {rows_text(bad)}; permutation "
                    f"v -> p(v): {rows_text(perm, 32)}; diagnosis of the {which}")
