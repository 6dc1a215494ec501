"""A linear-ce case's draws live in its folder (``kinds/linear_ce/draws.py``) and reach core
through ``KindSpec.draws`` and ``KindSpec.e_scale_at``: every linear-ce case still builds the
arrays it built when core drew them itself, through the public ``tyingspec.build`` (which
finds the kind) and at a ``--shape``."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import tyingspec
from tyingspec._src.core.cases import Batch, Case, at_shape, build
from tyingspec._src.kinds.table import KINDS, OPTIONS_KIND

SPEC = KINDS["linear-ce"]

# Digests of every linear-ce case's arrays (E, W, b, tokens, targets, class weights,
# grad_output, the options string with its drawn ignore_index) at seeds 0..3, computed with the
# code before the draws moved out of core/cases.py (tyingspec at 1f60d7a), as is and at
# V=48 d=12 N=20 (with each case's E scale and N): a changed draw changes them.
BUILT = {0: "1c7d2ba2fe055385", 1: "c50132caeaa3c39c", 2: "7a453f6274efd65a",
         3: "ed472441a50c95a1"}
SHAPED = {0: "b687aac53616659b", 1: "7f2aa926d08f61e1", 2: "aa5f5e6a36dd8da5",
          3: "846c07ff976b184b"}


def _digest(batch: Batch) -> str:
    h = hashlib.sha256()
    for name in ("E", "W", "b", "tokens", "targets", "ce_weight", "grad_output"):
        a = getattr(batch, name)
        h.update(name.encode())
        if a is not None:
            a = np.ascontiguousarray(a)
            h.update(str(a.dtype).encode())
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
    h.update(batch.ce.encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("seed", range(4))
def test_every_linear_ce_case_builds_the_arrays_it_built_in_core(seed: int) -> None:
    cases = SPEC.cases(seed)
    assert any(c.ce for c in cases)
    h = hashlib.sha256()
    for c in cases:
        public = tyingspec.build(c)
        assert _digest(public) == _digest(build(c, SPEC)), c.name
        h.update(c.name.encode())
        h.update(_digest(public).encode())
    assert h.hexdigest()[:16] == BUILT[seed]


@pytest.mark.parametrize("seed", range(4))
def test_every_linear_ce_case_keeps_its_arrays_at_a_shape(seed: int) -> None:
    kept, left_out = at_shape(SPEC.cases(seed), 48, 12, 20, SPEC)
    assert left_out == [] and len(kept) == len(SPEC.cases(seed))
    h = hashlib.sha256()
    for c in kept:
        h.update(c.name.encode())
        h.update(repr(c.e_scale).encode())
        h.update(str(c.N).encode())
        h.update(_digest(tyingspec.build(c)).encode())
    assert h.hexdigest()[:16] == SHAPED[seed]


def test_the_options_kind_is_the_one_that_draws() -> None:
    assert KINDS[OPTIONS_KIND] is SPEC and SPEC.draws is not None


def test_a_case_with_options_is_not_built_without_its_draws() -> None:
    # core alone would build it without its ignored targets: a batch other than the one its
    # check ran on, so it refuses rather than return that
    case = Case(name="ignored", V=16, d=4, N=12, seed=3, ce="ignored=0.5")
    with pytest.raises(ValueError, match="kind options"):
        build(case)
    with pytest.raises(ValueError, match="kind options"):
        at_shape([case], 32, 8, 16)
    batch = tyingspec.build(case)
    ignore_index = int(batch.ce.rpartition("ignore_index=")[2])
    assert (batch.targets == ignore_index).sum() >= 7  # at least a whole chunk ignored
