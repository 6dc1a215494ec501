"""Hypothesis strategies over vocab size, width, batch length and batch *composition*.

A drawn example is a :class:`tyingspec.Case`: shapes, settings and one integer seed; the arrays
are built from the seed by :func:`tyingspec.build`, never drawn element by element.  Shrinking
therefore moves towards small V, d, N, the first composition that still fails, float64, no bias
and seed 0, and the failing batch is printed with its explicit tokens, so it replays.

The composition is drawn first and the shapes are drawn to suit it (``distinct`` needs N <= V,
``crowded`` N > V, ``sparse`` leaves at least three quarters of the vocabulary absent), so no
example is wasted on a composition its shape cannot hold.  Usage::

    from hypothesis import given
    from tyingspec.properties import cases     # also tyingspec._src.core.strategies.cases

    @given(cases(compositions=("repeats", "one-token"), dtypes=("float32",)))
    def test_my_kernel(case): ...
"""

from __future__ import annotations

from hypothesis import strategies as st

from tyingspec._src.core.cases import COMPOSITIONS, Case

RES_VALUES = (1.0, 0.0, 0.6)  # res in {1, 0, other}
S_IN_VALUES = (1.0, 1.7, 0.4)
DTYPES = ("float64", "float32")

#: Compositions that always repeat a token (for duplicate-accumulation properties).
REPEATING = ("repeats", "multiplicity", "one-token", "crowded")
#: Compositions that (for V above a handful) leave tokens absent (for absent-row properties).
LEAVING_ROWS_ABSENT = ("distinct", "sparse", "repeats", "one-token", "multiplicity", "random",
                       "with-zero", "no-zero")

# One drawn example in 32 has E = 0: every path vanishes and a property must recognise the
# example as powerless instead of counting it.  A list, not a weight: sampled_from draws its
# index uniformly and shrinks towards index 0, the informative scale.
_E_SCALES = (1.0,) * 31 + (0.0,)
# One in four examples has V == d (a square E that transposition bugs can hide in).
_SQUARE = (False, False, False, True)


def compositions(names: tuple[str, ...] = COMPOSITIONS) -> st.SearchStrategy[str]:
    """A batch composition, a first-class choice (see :data:`core.cases.COMPOSITIONS`)."""
    unknown = [n for n in names if n not in COMPOSITIONS]
    if unknown or not names:
        raise ValueError(f"unknown compositions {unknown}; known: {', '.join(COMPOSITIONS)}")
    return st.sampled_from(names)


def cases(
    *,
    max_vocab: int = 48,
    max_width: int = 8,
    max_len: int = 40,
    dtypes: tuple[str, ...] = DTYPES,
    compositions: tuple[str, ...] = COMPOSITIONS,
    min_vocab: int = 1,
    min_len: int = 1,
    degenerate: bool = True,
) -> st.SearchStrategy[Case]:
    """A batch: composition, V (from ``min_vocab``), d, N (from ``min_len``), res, s_in, bias,
    dtype and a seed.

    ``compositions`` restricts which compositions are drawn; compositions a bound makes
    impossible (``sparse`` needs ``max_vocab >= 8``, ``crowded`` needs N > V within
    ``max_len``) are dropped.  ``degenerate=False`` never draws the E = 0 example.  Bad
    arguments raise ``ValueError`` here, not at the first draw.
    """
    if min_vocab < 1 or min_len < 1 or max_vocab < min_vocab or max_len < min_len \
            or max_width < 1:
        raise ValueError("need 1 <= min_vocab <= max_vocab, 1 <= min_len <= max_len and "
                         "max_width >= 1")
    unknown = [c for c in compositions if c not in COMPOSITIONS]
    bad_dtypes = [d for d in dtypes if d not in DTYPES]
    if unknown or bad_dtypes or not dtypes:
        raise ValueError(f"unknown compositions {unknown} or dtypes {bad_dtypes}; known: "
                         f"{', '.join(COMPOSITIONS)}; {', '.join(DTYPES)}")
    usable = tuple(c for c in compositions if _possible(c, max_vocab, max_len, min_vocab))
    if not usable:
        raise ValueError(f"no composition among {compositions} fits V <= {max_vocab}, "
                         f"N <= {max_len}")
    return _cases(max_vocab, max_width, max_len, dtypes, usable, min_vocab, min_len, degenerate)


@st.composite
def _cases(draw: st.DrawFn, max_vocab: int, max_width: int, max_len: int,
           dtypes: tuple[str, ...], usable: tuple[str, ...], min_vocab: int, min_len: int,
           degenerate: bool) -> Case:
    composition = draw(st.sampled_from(usable))
    V, N, distinct, multiplicity = draw(_shape(composition, max_vocab, max_len, min_vocab,
                                               min_len))
    # Drawn unconditionally: a draw that exists only for some V shifts every later choice when
    # the shrinker lowers V, and Hypothesis then stops shrinking V (seen: stuck at V=9, N=33).
    square = draw(st.sampled_from(_SQUARE)) and V <= max_width
    d = V if square else draw(st.integers(1, max_width))
    return Case(
        name=f"drawn-{composition}", V=V, d=d, N=N, seed=draw(st.integers(0, 2**32 - 1)),
        composition=composition, res=draw(st.sampled_from(RES_VALUES)),
        s_in=draw(st.sampled_from(S_IN_VALUES)), bias=draw(st.booleans()),
        distinct=distinct, multiplicity=multiplicity, dtype=draw(st.sampled_from(dtypes)),
        e_scale=draw(st.sampled_from(_E_SCALES)) if degenerate else 1.0,
    )


def _possible(c: str, max_vocab: int, max_len: int, min_vocab: int) -> bool:
    if c == "sparse":
        return max_vocab >= 8
    if c == "crowded":
        return max_len > min_vocab
    if c in ("repeats", "multiplicity", "one-token"):
        return max_len >= 2
    if c == "no-zero":
        return max_vocab >= 2
    return True


@st.composite
def _shape(draw: st.DrawFn, c: str, max_vocab: int, max_len: int, min_vocab: int,
           min_len: int) -> tuple[int, int, int | None, int | None]:
    """(V, N, distinct, multiplicity) suited to composition ``c``."""
    lo_len = max(min_len, 2 if c in ("repeats", "one-token", "multiplicity") else 1)
    if c == "distinct":
        V = draw(st.integers(max(min_vocab, lo_len), max(max_vocab, lo_len)))
        return V, draw(st.integers(lo_len, max(lo_len, min(V, max_len)))), None, None
    if c == "crowded":  # N > V: every token cannot be distinct, some row must repeat
        V = draw(st.integers(min_vocab, min(max_vocab, max_len - 1)))
        return V, draw(st.integers(max(V + 1, lo_len), max_len)), None, None
    if c == "sparse":  # at most a quarter of the vocabulary present
        V = draw(st.integers(max(8, min_vocab), max(8, max_vocab)))
        k = draw(st.integers(1, max(1, min(V // 4, max_len))))
        return V, draw(st.integers(max(k, lo_len), max(k, lo_len, max_len))), k, None
    if c == "multiplicity":  # k tokens seen exactly m times each, r singletons
        m = draw(st.integers(2, max(2, min(6, max_len))))
        k = draw(st.integers(1, max(1, max_len // m)))
        r = draw(st.integers(0, min(m - 1, max(0, max_len - k * m))))
        while k * m + r < lo_len:  # honour min_len by adding groups, never by breaking m
            k += 1
        V = draw(st.integers(max(min_vocab, k + r), max(max_vocab, k + r)))
        return V, k * m + r, k, m
    V = draw(st.integers(max(min_vocab, 2 if c == "no-zero" else 1), max(max_vocab, min_vocab)))
    N = draw(st.integers(lo_len, max(lo_len, max_len)))
    distinct = None
    if c == "repeats":
        distinct = draw(st.integers(1, max(1, min(V, N - 1))))
    return V, N, distinct, None
