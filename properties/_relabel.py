"""Relabelling the vocabulary: token ids are names, not semantics."""

from __future__ import annotations

import numpy as np

from tyingspec._cases import Case, build, closed_form
from tyingspec._diagnosis import diagnose
from tyingspec._probe import Paths
from tyingspec._strategies import cases

from ._common import (
    Adapter,
    agree,
    concrete,
    dE_scale,
    judged_dtype,
    kernel_case,
    rows_text,
    run_model,
    seeded,
)
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


@register("relabelling_permutes_rows", "PERM", ("model", "kernel"),
          lambda: cases(min_vocab=2))
def relabelling_permutes_rows(fn: Adapter, spec: str, kind: str, case: Case) -> None:
    """Relabelling the vocabulary by a permutation p (row v of E and entry v of b move to p(v);
    tokens and targets t become p(t)) permutes the rows of dE the same way: dE'[p(v)] = dE[v].
    Both gradients come from the implementation under test; no row is special."""
    batch = build(case)
    perm = permutation(case)
    paths = closed_form(batch)
    scale = dE_scale(batch)
    require_power(diagnose(paths.dE, paths, dtype=case.dtype, scale=scale))
    if kind == "kernel":
        k, _, _ = kernel_case(batch)
        dE, _ = k.call(spec, fn)
        g2 = np.empty_like(k.g)
        g2[:, perm] = k.g  # logit column v becomes column perm[v]
        dE2, _ = k.call(spec, fn, tokens=perm[k.tokens], g=g2)
    else:
        out = run_model(spec, fn, batch)
        out2 = run_model(spec, fn, batch, E=_permute_rows(batch.E, perm),
                         b=None if batch.b is None else _permute_rows(batch.b, perm),
                         tokens=perm[batch.tokens], targets=perm[batch.targets])
        dE, dE2 = out.dE, out2.dE
    back = np.asarray(dE2)[perm]  # row v of back is row perm[v] of the relabelled gradient
    dtype = judged_dtype(case, dE, dE2)
    ok = agree(back, dE, dtype, paths.dE, paths.dE_in, paths.dE_out, scale).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        # Say which of the two runs is wrong: the relabelled reference is the permuted one.
        diag = diagnose(dE, paths, dtype=dtype, scale=scale)
        which = "original batch"
        if not diag.wrong:
            moved = Paths(paths.loss, _permute_rows(paths.dE_in, perm),
                          _permute_rows(paths.dE_out, perm), paths.dW,
                          None if paths.db is None else _permute_rows(paths.db, perm),
                          paths.per_position, perm[paths.tokens])
            diag = diagnose(dE2, moved, dtype=dtype, scale=scale)
            which = "relabelled batch (relabelled ids)"
        raise PropertyFailure(
            "relabelling_permutes_rows",
            f"relabelling the vocabulary changed {bad.size} of {case.V} rows of dE "
            "beyond the permutation", concrete(case, batch), diagnosis=diag,
            details=f"rows (original ids) that differ: {rows_text(bad)}; permutation "
                    f"v -> p(v): {rows_text(perm, 32)}; diagnosis of the {which}")
