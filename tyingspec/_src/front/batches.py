"""``tyingspec.build(case)``: every array of a case, with its kind's draws.

Part of the API, and an entry point of the kind table: a case names no kind, but one with
options (``Case.ce``) is a case of the kind that draws them (the table's ``OPTIONS_KIND``,
linear-ce), so a printed case gives the batch its check ran on whoever builds it.  Its own
module, apart from :mod:`front.api`, so that building a batch loads numpy and the case format,
not the engine.
"""

from __future__ import annotations

from tyingspec._src.core.cases import Batch, Case
from tyingspec._src.core.cases import build as build_case
from tyingspec._src.kinds.table import KINDS, OPTIONS_KIND

__all__ = ["build"]


def build(case: Case) -> Batch:
    """Every array of ``case``, from its seed (weights at a scale where both paths matter);
    a case with options gets the draws of the kind whose options they are (linear-ce's
    ignored targets at a drawn ``ignore_index``, class weights, upstream gradient)."""
    return build_case(case, KINDS[OPTIONS_KIND] if case.ce else None)
