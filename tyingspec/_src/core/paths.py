"""The probe model and its closed-form gradient, split into the two paths into E.

Forward (the contract every reference and adapter shares)::

    x = s_in * E_in[tokens]; u = x @ W; h = res * x + tanh(u)
    logits = h @ E_out.T (+ b); loss = mean_n CE(logits[n], targets[n])

Tied means ``E_in is E_out``.  Everything here is plain numpy in the dtype of ``E``.
"""

from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tyingspec._src.core import memory, threads
from tyingspec._src.core.tolerance import Terms

Array = NDArray[np.floating]
IntArray = NDArray[np.integer]


@dataclass(frozen=True)
class Parts:
    """Intermediates of one forward/backward; every built-in implementation combines these."""

    loss: float
    x: Array  # [N, d] looked-up (and scaled) rows
    h: Array  # [N, d] hidden states fed to the output path
    g: Array  # [N, V] dL/dlogits
    dx: Array  # [N, d] dL/dx
    du: Array  # [N, d]
    dW: Array
    db: Array | None
    s_in: float

    @property
    def input_rows(self) -> Array:
        """Per-position contribution of the input path: dL/dE_in[tokens[n]] from position n."""
        return self.s_in * self.dx


@dataclass(frozen=True, eq=False)
class LowRank:
    """``E = scale * (A @ B + S)``, exactly: ``A [V, r]`` and ``B [r, d]`` hold small integers
    (float64), ``S`` holds one integer a row, ``spikes[v]`` at column ``v % d`` (E is then of
    full rank, ``min(V, d)``: the low-rank part alone left every direction outside B's r
    unreached), and ``scale`` is a power of two, so every partial sum of ``A @ B + S`` is an
    integer below 2**24 and E is the same matrix in float32 and float64, whatever the order of
    its sums (see ``core.cases.E_RANK``).  Then the reference's two V d N products go through
    the factors: ``h @ E.T = (scale * h @ B.T) @ A.T + scale * h[:, v % d] * spikes[v]`` and
    ``g @ E = scale * (g @ A) @ B + scale * sum_q (g * spikes)[:, q d + j]``, about (r + 1) / d
    of their cost, in float64 (below any rounding the bound allows a float32 reference).

    ``of`` is a weak reference to the E it factors: a batch whose E was replaced (stepped,
    released, cast) no longer matches, and is computed from its E as before."""

    A: Array
    B: Array
    scale: float
    of: weakref.ref[Any] = field(repr=False)
    spikes: Array | None = field(default=None, repr=False)  # [V]; None: no sparse part

    @property
    def rank(self) -> int:
        """The rank of the low-rank part (E itself is of full rank with its spikes)."""
        return int(self.A.shape[1])

    def factors(self, E: Any) -> bool:
        """Whether this is the factorization of the very array ``E``."""
        return self.of() is E

    def dense(self) -> Array:
        """E itself, in float64, from the factors (exact: see the class docstring)."""
        E: Array = self.A @ self.B
        if self.spikes is not None:
            rows = np.arange(E.shape[0])
            E[rows, rows % E.shape[1]] += self.spikes
        E *= self.scale
        return E

    def _spike_rows(self, d: int) -> tuple[Array, Array]:
        """``scale * spikes`` split as [q, d] (rows ``q d + j`` at column j) and the rest."""
        assert self.spikes is not None
        w = self.spikes * self.scale
        q = w.shape[0] // d
        return w[:q * d].reshape(q, d), w[q * d:]

    def _add_spikes_T(self, out: Array, h: Array) -> None:
        """``out [n, V] += h @ (scale * S).T`` in place (float64): entry (n, v) gains
        ``h[n, v % d] * scale * spikes[v]``.  A position at a time, over a [V] temporary in
        cache: at GPT-2 size this costs 0.05 CPU seconds for all 1024 positions, where a pass
        over a [64, V] temporary a block at a time cost twice that."""
        if self.spikes is None:
            return
        d = h.shape[1]
        w3, rest = self._spike_rows(d)
        whole = _split_columns(out, w3.shape[0], d)
        buf = np.empty_like(w3)
        for j in range(out.shape[0]):
            np.multiply(w3, h[j], out=buf)
            whole[j] += buf
        if rest.size:
            out[:, whole.shape[1] * d:] += h[:, :rest.size] * rest

    def _spikes_times(self, g: Array, d: int) -> Array:
        """``g @ (scale * S)`` ([n, d], float64): column j sums ``g[:, v] * scale *
        spikes[v]`` over the rows ``v % d == j`` (one einsum: half the time of a loop)."""
        w3, rest = self._spike_rows(d)
        acc: Array = np.einsum("nqd,qd->nd", _split_columns(g, w3.shape[0], d), w3)
        if rest.size:
            acc[:, :rest.size] += g[:, w3.shape[0] * d:] * rest
        return acc

    def times_rows_T(self, h: Array, dt: np.dtype[Any]) -> Array:
        """``h @ E.T`` ([N, V], in ``dt``, its pages in at once), computed in float64 a block
        of positions at a time, each block rounded once to ``dt``."""
        h64 = np.asarray(h, dtype=np.float64)
        hb = (h64 @ self.B.T) * self.scale  # [N, r]
        n, V = hb.shape[0], self.A.shape[0]
        out = memory.empty((n, V), dt)
        if out.dtype == np.float64:
            np.matmul(hb, self.A.T, out=out)
            for s in range(0, n, _LOW_RANK_ROWS):
                e = min(s + _LOW_RANK_ROWS, n)
                self._add_spikes_T(out[s:e], h64[s:e])
            return out
        tmp = np.empty((min(n, _LOW_RANK_ROWS), V))
        for s in range(0, n, _LOW_RANK_ROWS):
            e = min(s + _LOW_RANK_ROWS, n)
            np.matmul(hb[s:e], self.A.T, out=tmp[:e - s])
            self._add_spikes_T(tmp[:e - s], h64[s:e])
            out[s:e] = tmp[:e - s]
        return out

    def times(self, g: Array) -> Array:
        """``g @ E`` ([N, d] in g's dtype), computed in float64: ``g`` a block of positions at a
        time, then ``scale * (g @ A) @ B`` plus the spikes' part."""
        n, V = g.shape
        d = self.B.shape[1]
        gA = np.empty((n, self.A.shape[1]))
        gS = np.zeros((n, d))
        tmp = g if g.dtype == np.float64 else np.empty((min(n, _LOW_RANK_ROWS), V))
        for s in range(0, n, _LOW_RANK_ROWS):
            e = min(s + _LOW_RANK_ROWS, n)
            block = g[s:e]
            if tmp is not g:
                np.copyto(tmp[:e - s], block)
                block = tmp[:e - s]
            np.matmul(block, self.A, out=gA[s:e])
            if self.spikes is not None:
                gS[s:e] = self._spikes_times(block, d)
        out: Array = ((gA @ self.B) * self.scale + gS).astype(g.dtype, copy=False)
        return out


def _split_columns(a: Array, q: int, d: int) -> Array:
    """The first ``q d`` columns of ``a [n, V]`` as ``[n, q, d]``: a view, so that writing to it
    writes to ``a``."""
    view = a[:, :q * d].reshape(a.shape[0], q, d)
    assert view.size == 0 or np.may_share_memory(view, a), "not a view"
    return view


#: Positions per block of a :class:`LowRank` product in float64: a 26 MB temporary at a
#: GPT-2-size vocabulary, reused block after block.
_LOW_RANK_ROWS = 64


class _Factored:
    """A [V, d] path held in a cheaper form than the matrix: rows on demand (float64), and
    ``np.asarray`` (or indexing) builds the whole matrix once, for what needs all of it."""

    shape: tuple[int, int]
    dtype: np.dtype[Any]
    ndim = 2

    def rows(self, rows: IntArray) -> Array:
        raise NotImplementedError

    def block(self, start: int, stop: int) -> Array:
        """Rows ``[start, stop)`` (what a blocked comparison reads), not building the whole."""
        return self.rows(np.arange(start, min(stop, self.shape[0])))

    def _build(self) -> Array:
        raise NotImplementedError

    @cached_property
    def whole(self) -> Array:
        return self._build()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Array:
        return self.whole if dtype is None else self.whole.astype(dtype, copy=False)

    def __getitem__(self, index: Any) -> Array:
        out: Array = self.whole[index]
        return out

    def astype(self, dtype: Any, copy: bool = True) -> Array:
        return self.whole.astype(dtype, copy=copy)


class OutputPath(_Factored):
    """The output path ``g.T @ h`` kept as its two factors.  At GPT-2 size the whole [V, d]
    product costs as much as a third of the implementation's forward+backward, and a check
    needs only some of its rows entry by entry and the rest projected (see :class:`Sketch`)."""

    def __init__(self, g: Array, h: Array) -> None:
        self.g, self.h = g, h
        self.shape = (g.shape[1], h.shape[1])
        self.dtype = np.result_type(g.dtype, h.dtype)

    def rows(self, rows: IntArray) -> Array:
        # in the factors' own dtype, as the dense reference of a smaller shape computes every
        # row (the bound counts the reference's rounding), then float64: the 2019 exact rows of
        # a GPT-2-size batch in float32 took 0.10 s of a cold check's judgement, against 0.03 s
        out: Array = np.asarray(self.g[:, rows].T @ self.h, np.float64)
        return out

    def block(self, start: int, stop: int) -> Array:
        # in the factors' own dtype, as the whole product would be: a float32 reference read a
        # block at a time costs what building it whole did, and holds a block, not [V, d]
        out: Array = self.g[:, start:stop].T @ self.h
        return out

    def _build(self) -> Array:
        out: Array = self.g.T @ self.h
        return out


class InputPath(_Factored):
    """The input path as the rows its tokens touch (repeated tokens summed): a zeroed [V, d]
    matrix with a few rows written costs page faults over all of it."""

    def __init__(self, tokens: IntArray, per_position: Array, vocab_size: int) -> None:
        self.touched, self.sums = segment_sums(tokens, per_position)
        self.shape = (vocab_size, per_position.shape[1])
        self.dtype = per_position.dtype

    def rows(self, rows: IntArray) -> Array:
        out = np.zeros((len(rows), self.shape[1]))
        if len(self.touched):
            at = np.minimum(np.searchsorted(self.touched, rows), len(self.touched) - 1)
            hit = self.touched[at] == rows
            out[hit] = self.sums[at[hit]]
        return out

    def _build(self) -> Array:
        out = np.zeros(self.shape, dtype=self.dtype)
        out[self.touched] = self.sums
        return out


@dataclass(frozen=True)
class Sketch:
    """Rows judged through projections (Freivalds' check), for shapes where the whole output
    path costs as much as a forward pass.

    Rows in ``exact`` (the batch's tokens and targets, the padding row) are compared entry by
    entry.  Every other row carries the output path alone, and is compared through the columns
    of ``Z [d, k]``: ``(dE @ Z)[v]`` against ``(g.T @ (h @ Z))[v]``, which costs
    ``O((V + d) N k)`` instead of ``V d N``.  The allowance of column ``q`` is the row's
    entrywise bound summed the same way, ``sum_j |Z[j, q]| (atol_v + rtol |e[v, j]|)``, with
    ``sum_j |Z[j, q]| |e[v, j]|`` bounded by ``mag = |g|.T @ (|h| @ |Z|)``: a row within its
    entrywise bound is within every projected one.

    ``Z`` holds ``SAMPLED_COLUMNS`` unit vectors (entries of the row, checked under exactly
    their entrywise bound: a bug that moves a whole row, as output-path bugs do, is seen in any
    of them) and ``GAUSSIAN_DIRECTIONS`` Gaussian ones (an error confined to entries no sampled
    column hit still moves them, once it is large against the row's summed bound)."""

    exact: IntArray  # sorted rows compared entry by entry
    Z: Array  # [d, k] float64 directions, drawn from ``seed``
    columns: IntArray  # the sampled columns: Z[:, :len(columns)] is their unit vectors
    seed: int
    out: Array  # [V, k] float64: dE_out @ Z
    mag: Array  # [V, k] float64: |g|.T @ (|h| @ |Z|)

    def with_exact(self, rows: IntArray) -> Sketch:
        """The same projections with ``rows`` also compared entry by entry."""
        return replace(self, exact=np.union1d(self.exact, np.asarray(rows, dtype=np.int64)))


#: Entries of each projected row compared under their own bound (all of them when d is
#: smaller): a row wrong in a fraction f of its entries escapes with probability (1 - f)^24.
SAMPLED_COLUMNS = 24
#: Gaussian directions per projected row, for errors confined to entries no column sampled.
GAUSSIAN_DIRECTIONS = 8
#: Shapes whose output path is above this many multiply-adds (V d N) are judged with a
#: :class:`Sketch`; below it every row is compared entry by entry.
SKETCH_ABOVE = 2**26


def row_block(a: Array | _Factored, start: int, stop: int) -> Array:
    """Rows ``[start, stop)`` of a [V, d] matrix or factored path."""
    if isinstance(a, _Factored):
        return a.block(start, stop)
    out: Array = a[start:stop]
    return out


def sketched(V: int, d: int, n: int) -> bool:
    """Whether a reference of this shape judges its absent rows through projections."""
    return V * d * n > SKETCH_ABOVE


def sketch_directions(tokens: IntArray, targets: IntArray | None, d: int
                      ) -> tuple[Array, IntArray, int]:
    """``Z [d, k]`` (sampled columns, then Gaussian directions), the sampled columns and the
    seed, drawn from the batch itself: a replay of the case (same tokens and targets) draws
    the same."""
    seed = zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    if targets is not None:
        seed = zlib.crc32(np.ascontiguousarray(targets, dtype=np.int64).tobytes(), seed)
    rng = np.random.default_rng(seed)
    cols = np.sort(rng.choice(d, size=min(d, SAMPLED_COLUMNS), replace=False))
    sampled = np.zeros((d, cols.shape[0]))
    sampled[cols, np.arange(cols.shape[0])] = 1.0
    return np.hstack([sampled, rng.standard_normal((d, GAUSSIAN_DIRECTIONS))]), cols, seed


Directions = tuple[Array, IntArray, int]  # what sketch_directions draws


def draw_directions(V: int, d: int, n: int, tokens: IntArray, targets: IntArray | None,
                    sketch: bool | None) -> Directions | None:
    """The sketch's directions when a reference of this shape is sketched (``sketch``, when
    given, overrides the size rule); None when every row is compared entry by entry."""
    if not (sketched(V, d, n) if sketch is None else sketch):
        return None
    return sketch_directions(tokens, targets, d)


def input_path(tokens: IntArray, rows: Array, vocab_size: int, *, factored: bool
               ) -> Array | InputPath:
    """The input path: the touched rows alone (a sketched reference), or the whole matrix."""
    if factored:
        return InputPath(tokens, rows, vocab_size)
    return scatter_rows(tokens, rows, vocab_size)


def two_paths(tokens: IntArray, per_position: Array, g: Array, h: Array, vocab_size: int,
              exact: IntArray, drawn: Directions | None,
              projected: tuple[Array, Array] | None
              ) -> tuple[Array | InputPath, Array | OutputPath, Sketch | None]:
    """A reference's input path, output path and sketch: whole matrices without directions;
    with them, factored paths and the sketch that judges the rows outside ``exact``."""
    dE_in = input_path(tokens, per_position, vocab_size, factored=drawn is not None)
    if drawn is None:
        return dE_in, g.T @ h, None
    assert projected is not None  # directions given: the bound terms projected them
    Z, columns, seed = drawn
    return dE_in, OutputPath(g, h), Sketch(exact, Z, columns, seed, *projected)


@dataclass(frozen=True)
class Paths:
    """The tied gradient split into its two paths (closed form), plus the other gradients."""

    loss: float
    dE_in: Array | InputPath  # input path: scatter-add of s_in*dx over token rows
    dE_out: Array | OutputPath  # output path: g.T @ h (its factors, when sketched)
    dW: Array
    db: Array | None
    per_position: Array  # [N, d] input-path contribution of each position
    tokens: IntArray
    terms: Terms | None = None  # what the rounding bound is built from (see _tolerance)
    padding_idx: int | None = None  # the row the input path skips by declaration, if any
    sketch: Sketch | None = None  # absent rows judged through projections (large shapes)
    # the input path the padding row would get without padding_idx: its positions' rows
    # summed (a backward that skips the mask adds exactly this)
    pad_input: Array | None = None

    @property
    def dE(self) -> Array:
        out: Array = np.asarray(self.dE_in) + np.asarray(self.dE_out)
        return out

    def in_rows(self, rows: IntArray) -> Array:
        """Rows of the input path in float64 (without building all of it when sketched)."""
        return _path_rows(self.dE_in, rows)

    def out_rows(self, rows: IntArray) -> Array:
        """Rows of the output path in float64 (without building all of it when sketched)."""
        return _path_rows(self.dE_out, rows)


    @property
    def bound_terms(self) -> Terms:
        """What the row bound is built from: the reference's own terms, or for hand-built
        paths the row magnitudes of the paths themselves."""
        if self.terms is not None:
            return self.terms
        return Terms.from_paths(np.asarray(self.dE_in, np.float64),
                                np.asarray(self.dE_out, np.float64))


def _path_rows(path: Array | _Factored, rows: IntArray) -> Array:
    if isinstance(path, _Factored):
        return path.rows(rows)
    return np.asarray(path[rows], dtype=np.float64)


def flatten_batch(tokens: object, targets: object) -> tuple[IntArray, IntArray]:
    """Tokens/targets as [N] or [B, T] (flattened row-major) integer arrays."""
    t = np.asarray(tokens).reshape(-1)
    y = np.asarray(targets).reshape(-1)
    return t, y


def forward_parts(
    E_in: Array,
    E_out: Array,
    W: Array,
    b: Array | None,
    tokens: IntArray,
    targets: IntArray,
    res: float = 1.0,
    s_in: float = 1.0,
    *,
    out_factors: LowRank | None = None,
) -> Parts:
    """Forward and backward of the probe model up to (not including) the gradient into E;
    ``out_factors``, E_out's :class:`LowRank` factors, computes its two products through
    them."""
    tokens, targets = flatten_batch(tokens, targets)
    n = tokens.shape[0]
    dt = np.result_type(E_in.dtype, np.float32)
    res_c = dt.type(res)
    s_c = dt.type(s_in)
    x = s_c * E_in[tokens]
    u = x @ W
    t = np.tanh(u)
    h = res_c * x + t
    # The softmax in place on one [N, V] buffer: at V = 50257 each extra temporary costs as
    # much as a matrix product.
    g = _times_rows_T(h, E_out, out_factors)
    at_target, z = _softmax_in_place(g, b, targets)
    loss = float((np.log(z) - at_target).mean()) if n else float("nan")
    dh = _times_rows(g, E_out, out_factors)
    du = dh * (1 - t * t)
    dx = res_c * dh + du @ W.T
    dW = x.T @ du
    db = g.sum(axis=0) if b is not None else None
    return Parts(loss=loss, x=x, h=h, g=g, dx=dx, du=du, dW=dW, db=db, s_in=float(s_in))


#: Rows of ``g`` one step of :func:`_softmax_in_place` works on: 8 rows of a GPT-2-size
#: vocabulary are 1.6 MB in float32, so its five passes run in cache, not over 206 MB each.
_SOFTMAX_ROWS = 8
#: Entries of ``g`` from which its softmax is split over the cores: below it, starting the
#: threads costs about what they save.
_SOFTMAX_THREADS_ABOVE = 1 << 20


def _softmax_in_place(g: Array, b: Array | None, targets: IntArray) -> tuple[Array, Array]:
    """``g`` (the logits, [N, V]) becomes ``(softmax(g + b) - onehot(targets)) / N``, row by
    row; returns each row's shifted logit at its target and its sum of exponentials (for the
    loss).  Rows are independent, so blocks of them run on every core (each row's result is
    the one a pass over the whole buffer gives: the same reductions along the same row)."""
    n = g.shape[0]
    dt = g.dtype.type
    at_target = np.empty(n, dtype=g.dtype)
    z = np.empty(n, dtype=g.dtype)
    inv_n = dt(1) / dt(n) if n else dt(0)

    def part(rows: slice) -> None:
        for s in range(rows.start, rows.stop, _SOFTMAX_ROWS):
            e = min(s + _SOFTMAX_ROWS, rows.stop)
            blk = g[s:e]
            if b is not None:
                blk += b
            blk -= blk.max(axis=1, keepdims=True)  # shifted logits
            local = np.arange(e - s)
            at_target[s:e] = blk[local, targets[s:e]]
            np.exp(blk, out=blk)
            zb = blk.sum(axis=1, keepdims=True)
            z[s:e] = zb[:, 0]
            blk *= (1 / (zb * dt(n))).astype(g.dtype, copy=False)  # softmax / N
            blk[local, targets[s:e]] -= inv_n

    threads.on_cores(part, threads.row_ranges(
        n, threads.cores() if g.size >= _SOFTMAX_THREADS_ABOVE else 1))
    return at_target, z


#: Bytes of E cast at a time where E's dtype has no BLAS (bfloat16, float16): numpy's matmul
#: would otherwise cast the whole of it first, a float32 [V, d] beside it (2.1 GB at Llama-3's
#: head, more than a bfloat16 E itself).
_CAST_BYTES = 64 << 20


def _cast_blocks(E: Array) -> list[slice] | None:
    """Row blocks of ``E`` to cast one at a time, or None when its dtype is BLAS's own."""
    if E.dtype in (np.float32, np.float64):
        return None
    rows = max(1, _CAST_BYTES // max(1, 4 * E.shape[1]))
    return [slice(s, s + rows) for s in range(0, E.shape[0], rows)]


def _times_rows_T(h: Array, E: Array, factors: LowRank | None = None) -> Array:
    """``h @ E.T`` into one [N, V] buffer (its pages faulted in at once); through E's
    ``factors`` when given."""
    dt = np.result_type(h, E)
    if factors is not None:
        return factors.times_rows_T(h, dt)
    out = memory.empty((h.shape[0], E.shape[0]), dt)
    blocks = _cast_blocks(E)
    if blocks is None:
        return np.matmul(h, E.T, out=out)
    for b in blocks:  # each entry is the same dot product over d as the whole product's
        np.matmul(h, E[b].astype(dt).T, out=out[:, b])
    return out


def _times_rows(g: Array, E: Array, factors: LowRank | None = None) -> Array:
    """``g @ E``, summed over blocks of E's rows where E must be cast (see ``_CAST_BYTES``);
    through E's ``factors`` when given."""
    if factors is not None:
        return factors.times(g)
    blocks = _cast_blocks(E)
    if blocks is None:
        out: Array = g @ E
        return out
    dt = np.result_type(g, E)
    acc = np.zeros((g.shape[0], E.shape[1]), dtype=dt)
    for b in blocks:
        acc += g[:, b] @ E[b].astype(dt)
    return acc


def segment_sums(tokens: IntArray, rows: Array) -> tuple[IntArray, Array]:
    """The distinct tokens (sorted) and, for each, the sum of its rows: what ``np.add.at``
    adds into a token's row, at a fraction of its cost (one segmented sum over the tokens
    sorted; the order of a row's additions may differ, its rounding stays that of a sum)."""
    if not tokens.shape[0]:
        return np.zeros(0, dtype=np.int64), np.zeros((0, rows.shape[1]), dtype=rows.dtype)
    order = np.argsort(tokens, kind="stable")
    t = tokens[order]
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    sums: Array = np.add.reduceat(rows[order], starts, axis=0)
    return t[starts].astype(np.int64), sums


def scatter_rows(tokens: IntArray, rows: Array, vocab_size: int) -> Array:
    """Sparse input path: add each row into its token's row; repeated tokens add."""
    out = np.zeros((vocab_size, rows.shape[1]), dtype=rows.dtype)
    touched, sums = segment_sums(np.asarray(tokens).reshape(-1), rows)
    out[touched] = sums
    return out


def closed_form_paths(
    E: Array,
    W: Array,
    b: Array | None,
    tokens: object,
    targets: object,
    res: float = 1.0,
    s_in: float = 1.0,
    *,
    E_out: Array | None = None,
    sketch: bool | None = None,
    factors: LowRank | None = None,
) -> Paths:
    """Closed-form reference: both paths of dL/dE (``E_out`` defaults to ``E``: tied).
    ``sketch``: judge absent rows through projections (default: above ``SKETCH_ABOVE``);
    ``factors``: E's :class:`LowRank` factors (tied only), for its products."""
    t, y = flatten_batch(tokens, targets)
    out = E if E_out is None else E_out
    p = forward_parts(E, out, W, b, t, y, res, s_in,
                      out_factors=factors if E_out is None else None)
    per_pos = p.input_rows
    V, d = out.shape
    drawn = draw_directions(V, d, t.shape[0], t, y, sketch)
    terms, projected = model_terms(E, out, W, b, t, y, res, s_in, p,
                                   None if drawn is None else drawn[0])
    dE_in, dE_out, judged = two_paths(t, per_pos, p.g, p.h, V,
                                      np.union1d(t, y).astype(np.int64), drawn, projected)
    return Paths(loss=p.loss, dE_in=dE_in, dE_out=dE_out, dW=p.dW, db=p.db,
                 per_position=per_pos, tokens=t, terms=terms, sketch=judged)


def _abs_max_rows(a: Array) -> Array:
    """max_j |a[n, j]| per row, in float64, without a float64 copy of ``a``."""
    out: Array = np.abs(a).max(axis=1, initial=0.0).astype(np.float64)
    return out


#: Rows per block when a magnitude is summed over a large matrix: a few MB of temporaries
#: instead of a whole [N, V] or [V, d] copy.
_BLOCK = 64


#: Positions of ``|g|`` per block in :func:`_output_rows`: 26 MB of a GPT-2-size vocabulary in
#: float32, few enough products that each is large (64 took 0.11-0.14 s a call, 128 0.09).
_G_BLOCK = 128


def _output_rows(g: Array, h: Array, targets: IntArray, e_rows: Array | None = None,
                 Z: Array | None = None, *, softmax_g: bool = False
                 ) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
    """sum_n (|g[n, v]| + [y_n = v]/N) max_j |h[n, j]| per row v, the same weights' column
    sums (the db magnitude), per position sum_v |g[n, v]| max_j |E[v, j]| (the size of the
    terms of dh = g @ E, whatever cancels among them; zeros without ``e_rows``), and with
    directions ``Z [d, k]`` the output path's projections ``g.T @ (h @ Z)`` and their
    magnitudes ``|g|.T @ (|h| @ |Z|)`` (see :class:`Sketch`), all in one pass over ``g``.

    ``softmax_g``: ``g`` is :func:`forward_parts`'s, ``(softmax - onehot(targets)) / N``, so
    its only entries below zero are at ``(n, targets[n])``; then ``|g| = g - 2 min(g, 0)``
    there alone, and one product reads ``g`` once for the magnitudes and the projections
    (0.07 s against 0.15-0.17 s by blocks of ``|g|`` at GPT-2 size)."""
    n, V = g.shape
    h_inf = _abs_max_rows(h)
    k = 0 if Z is None else Z.shape[1]
    # one left-hand side for the |g| products: max |h| per position, |h| @ |Z|, and ones (the
    # column sums), so each block of |g| is read by one product (and dh's terms) only
    h64 = np.asarray(h, np.float64)
    right = h_inf[:, None] if Z is None else np.hstack([h_inf[:, None], np.abs(h64) @ np.abs(Z)])
    left = np.hstack([right, np.ones((n, 1))]).astype(g.dtype)
    # The projections in g's own dtype, as the whole product would be: the reference's
    # rounding, which the bound's factor 2 counts (a sampled column is the column of the
    # g.T @ h a dense reference computes in that dtype, up to the order of the sums).
    hz = None if Z is None else (h64 @ Z).astype(g.dtype)
    if softmax_g and targets.shape[0] == n and n:
        sums_t, dh_terms, proj = _signed_sums(g, targets, left, e_rows, hz)
    else:
        sums_t, dh_terms, proj = _abs_sums(g, left, e_rows, hz)
    sums, col = sums_t[:1 + k].T, sums_t[1 + k]
    # the target's probability enters g as p - 1: count it even when g ~ 0 (a fitted batch)
    tgt = np.bincount(targets, minlength=V)[:V] / max(n, 1)
    tgt_h = np.bincount(targets, weights=h_inf, minlength=V)[:V] / max(n, 1)
    projected = None
    if proj is not None:
        tgt_z = np.zeros((V, k))
        if targets.shape[0] == n:  # a kernel's call has no targets: its g already holds them
            np.add.at(tgt_z, targets, right[:, 1:] / max(n, 1))
        projected = (proj, sums[:, 1:] + tgt_z)
    return sums[:, 0] + tgt_h, col + tgt, dh_terms, projected


def _abs_sums(g: Array, left: Array, e_rows: Array | None, hz: Array | None
              ) -> tuple[Array, Array, Array | None]:
    """``left.T @ |g|``, ``|g| @ e_rows`` and ``g.T @ hz`` for any ``g``: ``|g|`` a block of
    positions at a time, in g's own dtype."""
    n, V = g.shape
    sums_t = np.zeros((left.shape[1], V))
    dh_terms = np.zeros(n)
    buf = np.empty((min(n, _G_BLOCK), V), dtype=g.dtype)  # one block's pages, faulted once
    for s in range(0, n, _G_BLOCK):
        w = np.abs(g[s:s + _G_BLOCK], out=buf[:min(n - s, _G_BLOCK)])
        sums_t += left[s:s + _G_BLOCK].T @ w
        if e_rows is not None:
            dh_terms[s:s + _G_BLOCK] = w @ e_rows
    proj = None if hz is None else np.asarray(g.T @ hz, dtype=np.float64)
    return sums_t, dh_terms, proj


def _signed_sums(g: Array, targets: IntArray, left: Array, e_rows: Array | None,
                 hz: Array | None) -> tuple[Array, Array, Array | None]:
    """What :func:`_abs_sums` returns, for a ``g`` below zero at ``(n, targets[n])`` alone:
    ``left.T @ g`` and ``hz.T @ g`` as one product, then ``|g| - g = -2 min(g, 0)`` added at
    those entries (every term of every sum is the same magnitude as before; only the order in
    which they are added differs)."""
    n = g.shape[0]
    lhs = left if hz is None else np.hstack([left, hz])
    both = np.asarray(lhs.T @ g, dtype=np.float64)
    m = left.shape[1]
    sums_t = both[:m]
    at_target = g[np.arange(n), targets].astype(np.float64)
    lift = -2.0 * np.minimum(at_target, 0.0)
    np.add.at(sums_t.T, targets, lift[:, None] * left.astype(np.float64))
    dh_terms = np.zeros(n)
    if e_rows is not None:
        dh_terms = np.asarray(g @ e_rows, dtype=np.float64) + \
            lift * e_rows[targets].astype(np.float64)
    proj = None if hz is None else np.ascontiguousarray(both[m:].T)
    return sums_t, dh_terms, proj


#: Rows of E per block of :func:`_abs_rows` (3 MB of a GPT-2-size E in float32).
_ABS_ROWS = 16 * _BLOCK


def _abs_rows(E: Array) -> tuple[Array, float]:
    """max_j |E[v, j]| per row, and the largest row sum of |E|: one blocked pass over E, its
    blocks on every core."""
    V = E.shape[0]
    row_max = np.zeros(V, dtype=E.dtype)
    row_sum = np.zeros(V)

    def block(b: slice) -> None:
        a = np.abs(E[b])
        if a.size:
            row_max[b] = a.max(axis=1)
            row_sum[b] = a.sum(axis=1, dtype=np.float64)

    threads.on_row_blocks(block, V, _ABS_ROWS)
    return row_max, float(row_sum.max(initial=0.0))


def input_path_terms(tokens: IntArray, rows_inf: Array, dh_terms: Array, W: Array, res: float,
                     s_in: float, V: int) -> Array:
    """The input path's part of each row's bound: the sum of its occurrences' ``rows_inf``
    (max |s_in dx[n]|), and their rounding.  dx[n] carries the rounding of dh[n] = g[n] @ E,
    whose terms (``dh_terms[n]``; the probe model's: sum_v |g[n, v]| max_j |E[v, j]|) can be
    much larger than their sum: g sums to 0, and a softmax saturated at its target has
    p - 1 ~ 0, rounded at 1.
    The body takes dh to dx through ``res`` and ``W``.  Those per-position rounding errors are
    independent, so they add in quadrature over a token's occurrences: a token seen 1024 times
    keeps a bound that can still tell a lost occurrence."""
    w_inf = float(np.abs(np.asarray(W, dtype=np.float64)).sum(axis=1).max(initial=0.0))
    cancel = abs(s_in) * np.asarray(dh_terms, np.float64) * (abs(res) + w_inf)
    summed = np.bincount(tokens, weights=rows_inf, minlength=V)[:V]
    rounded = np.sqrt(np.bincount(tokens, weights=cancel * cancel, minlength=V)[:V])
    out: Array = np.asarray(summed + rounded, dtype=np.float64)
    return out


def model_terms(E_in: Array, E_out: Array, W: Array, b: Array | None, tokens: IntArray,
                targets: IntArray, res: float, s_in: float, p: Parts, Z: Array | None = None
                ) -> tuple[Terms, tuple[Array, Array] | None]:
    """Bound terms of the probe model on one batch (see :mod:`core.tolerance`), and with
    directions ``Z`` the output path's projections and their magnitudes."""
    V, d = E_out.shape
    n = tokens.shape[0]
    h_inf = _abs_max_rows(p.h)
    e_rows, row_sum_max = _abs_rows(E_out)
    out_rows, db, dh_terms, projected = _output_rows(p.g, p.h, targets,
                                                     e_rows.astype(p.g.dtype), Z,
                                                     softmax_g=True)
    e_max = float(e_rows.max(initial=0))
    if E_in is not E_out:  # tied: one matrix, one pass
        e_max = max(e_max, float(_abs_rows(E_in)[0].max(initial=0)))
    in_rows = input_path_terms(tokens, abs(s_in) * _abs_max_rows(p.dx), dh_terms, W, res,
                               s_in, V)
    b_max = 0.0 if b is None else float(np.abs(b).max(initial=0.0))
    logit = float(h_inf.max(initial=0.0)) * row_sum_max + b_max
    k = d + n + float(np.sqrt(V)) + logit
    x = np.abs(np.asarray(p.x, dtype=np.float64))
    # |du| plus what it can be whatever cancels inside g @ E (so a dW that is 0 in truth, e.g.
    # V = 1, still gets an allowance for the rounding of g)
    du = np.abs(np.asarray(p.du, dtype=np.float64)) + 2.0 / max(n, 1) * e_max
    return Terms(rows=out_rows + in_rows, k=k, loss=logit + abs(p.loss), dW=x.T @ du,
                 db=db if b is not None else None), projected


def kernel_terms(tokens: IntArray, dx: Array, h: Array, g: Array, V: int,
                 Z: Array | None = None) -> tuple[Terms, tuple[Array, Array] | None]:
    """Bound terms of a kernel call (its inputs are given, only its reductions round), and
    with directions ``Z`` the output path's projections and their magnitudes."""
    rows, _, _, projected = _output_rows(g, h, np.zeros(0, dtype=np.int64), Z=Z)
    rows = rows + np.bincount(tokens, weights=_abs_max_rows(dx), minlength=V)[:V]
    return Terms(rows=rows, k=float(tokens.shape[0] + np.sqrt(V) + 1)), projected


def loss_only(
    E_in: Array,
    E_out: Array,
    W: Array,
    b: Array | None,
    tokens: IntArray,
    targets: IntArray,
    res: float = 1.0,
    s_in: float = 1.0,
) -> float:
    """The probe model's loss; used by central differences and training loops."""
    tokens, targets = flatten_batch(tokens, targets)
    x = s_in * E_in[tokens]
    h = res * x + np.tanh(x @ W)
    logits = h @ E_out.T
    if b is not None:
        logits = logits + b
    m = logits.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    return float((logz - logits[np.arange(tokens.shape[0]), targets]).mean())
