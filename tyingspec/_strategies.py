"""Hypothesis strategies over vocab size, width, batch length and batch *composition*.

A drawn example is a :class:`tyingspec.Case`: shapes, settings and one integer seed; the arrays
are built from the seed by :func:`tyingspec.build`, never drawn element by element.  Shrinking
therefore moves towards small V, d, N and simple compositions, and a printed case replays.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ._cases import Case

RES_VALUES = (1.0, 0.0, 0.6)
S_IN_VALUES = (1.0, 1.7, 0.4)


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    max_vocab: int = 48,
    max_width: int = 8,
    max_len: int = 40,
    dtypes: tuple[str, ...] = ("float64",),
    compositions: tuple[str, ...] = ("random", "distinct", "repeats", "one-token", "with-zero"),
) -> Case:
    """Cases covering every batch composition; ``compositions`` restricts which are drawn."""
    composition = draw(st.sampled_from(compositions))
    V = draw(st.integers(2 if composition == "distinct" else 1, max_vocab))
    d = draw(st.integers(1, max_width))
    lo = 2 if composition == "repeats" else 1
    hi = min(V, max_len) if composition == "distinct" else max_len
    N = draw(st.integers(lo, max(lo, hi)))
    distinct = draw(st.integers(1, max(1, min(V, N - 1)))) if composition == "repeats" else None
    return Case(
        name="drawn", V=V, d=d, N=N, seed=draw(st.integers(0, 2**32 - 1)),
        composition=composition, res=draw(st.sampled_from(RES_VALUES)),
        s_in=draw(st.sampled_from(S_IN_VALUES)), bias=draw(st.booleans()),
        distinct=distinct, dtype=draw(st.sampled_from(dtypes)),
    )
