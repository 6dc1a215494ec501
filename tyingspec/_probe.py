"""The probe model and its closed-form gradient, split into the two paths into E.

Forward (the contract every reference and adapter shares)::

    x = s_in * E_in[tokens]; u = x @ W; h = res * x + tanh(u)
    logits = h @ E_out.T (+ b); loss = mean_n CE(logits[n], targets[n])

Tied means ``E_in is E_out``.  Everything here is plain numpy in the dtype of ``E``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ._tolerance import Terms

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


@dataclass(frozen=True)
class Paths:
    """The tied gradient split into its two paths (closed form), plus the other gradients."""

    loss: float
    dE_in: Array  # input path: scatter-add of s_in*dx over token rows
    dE_out: Array  # output path: g.T @ h
    dW: Array
    db: Array | None
    per_position: Array  # [N, d] input-path contribution of each position
    tokens: IntArray
    terms: Terms | None = None  # what the rounding bound is built from (see _tolerance)
    padding_idx: int | None = None  # the row the input path skips by declaration, if any

    @property
    def dE(self) -> Array:
        return self.dE_in + self.dE_out

    @property
    def bound_terms(self) -> Terms:
        """What the row bound is built from: the reference's own terms, or for hand-built
        paths the row magnitudes of the paths themselves."""
        if self.terms is not None:
            return self.terms
        return Terms.from_paths(np.asarray(self.dE_in, np.float64),
                                np.asarray(self.dE_out, np.float64))


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
) -> Parts:
    """Forward and backward of the probe model up to (not including) the gradient into E."""
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
    g = h @ E_out.T
    if b is not None:
        g += b
    g -= g.max(axis=1, keepdims=True)  # shifted logits
    rows = np.arange(n)
    at_target = g[rows, targets].copy()
    np.exp(g, out=g)
    z = g.sum(axis=1, keepdims=True)
    loss = float((np.log(z[:, 0]) - at_target).mean()) if n else float("nan")
    g *= (1 / (z * dt.type(n))).astype(dt, copy=False)  # softmax / N
    g[rows, targets] -= dt.type(1) / dt.type(n)
    dh = g @ E_out
    du = dh * (1 - t * t)
    dx = res_c * dh + du @ W.T
    dW = x.T @ du
    db = g.sum(axis=0) if b is not None else None
    return Parts(loss=loss, x=x, h=h, g=g, dx=dx, du=du, dW=dW, db=db, s_in=float(s_in))


def scatter_rows(tokens: IntArray, rows: Array, vocab_size: int) -> Array:
    """Sparse input path: add each row into its token's row; repeated tokens add."""
    out = np.zeros((vocab_size, rows.shape[1]), dtype=rows.dtype)
    np.add.at(out, tokens, rows)
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
) -> Paths:
    """Closed-form reference: both paths of dL/dE (``E_out`` defaults to ``E``: tied)."""
    t, y = flatten_batch(tokens, targets)
    out = E if E_out is None else E_out
    p = forward_parts(E, out, W, b, t, y, res, s_in)
    per_pos = p.input_rows
    return Paths(
        loss=p.loss,
        dE_in=scatter_rows(t, per_pos, E.shape[0]),
        dE_out=p.g.T @ p.h,
        dW=p.dW,
        db=p.db,
        per_position=per_pos,
        tokens=t,
        terms=model_terms(E, out, W, b, t, y, res, s_in, p),
    )


def _abs_max_rows(a: Array) -> Array:
    """max_j |a[n, j]| per row, in float64, without a float64 copy of ``a``."""
    out: Array = np.abs(a).max(axis=1, initial=0.0).astype(np.float64)
    return out


#: Rows per block when a magnitude is summed over a large matrix: a few MB of temporaries
#: instead of a whole [N, V] or [V, d] copy.
_BLOCK = 64


def _output_rows(g: Array, h_inf: Array, targets: IntArray,
                 e_rows: Array | None = None) -> tuple[Array, Array, Array]:
    """sum_n (|g[n, v]| + [y_n = v]/N) max_j |h[n, j]| per row v, the same weights' column
    sums (the db magnitude), and per position sum_v |g[n, v]| max_j |E[v, j]| (the size of
    the terms of dh = g @ E, whatever cancels among them; zeros without ``e_rows``)."""
    n, V = g.shape
    rows = np.zeros(V)
    col = np.zeros(V)
    dh_terms = np.zeros(n)
    hw = h_inf.astype(g.dtype)
    for s in range(0, n, _BLOCK):  # |g| in blocks of positions, in g's own dtype
        w = np.abs(g[s:s + _BLOCK])
        rows += w.T @ hw[s:s + _BLOCK]
        col += w.sum(axis=0)
        if e_rows is not None:
            dh_terms[s:s + _BLOCK] = w @ e_rows
    # the target's probability enters g as p - 1: count it even when g ~ 0 (a fitted batch)
    tgt = np.bincount(targets, minlength=V)[:V] / max(n, 1)
    tgt_h = np.bincount(targets, weights=h_inf, minlength=V)[:V] / max(n, 1)
    return rows + tgt_h, col + tgt, dh_terms


def _abs_rows(E: Array) -> tuple[Array, float]:
    """max_j |E[v, j]| per row, and the largest row sum of |E|: one blocked pass over E."""
    row_max = np.zeros(E.shape[0], dtype=E.dtype)
    sum_max = 0.0
    for s in range(0, E.shape[0], 16 * _BLOCK):
        a = np.abs(E[s:s + 16 * _BLOCK])
        if a.size:
            row_max[s:s + 16 * _BLOCK] = a.max(axis=1)
            sum_max = max(sum_max, float(a.sum(axis=1, dtype=np.float64).max()))
    return row_max, sum_max


def model_terms(E_in: Array, E_out: Array, W: Array, b: Array | None, tokens: IntArray,
                targets: IntArray, res: float, s_in: float, p: Parts) -> Terms:
    """Bound terms of the probe model on one batch (see :mod:`tyingspec._tolerance`)."""
    V, d = E_out.shape
    n = tokens.shape[0]
    h_inf = _abs_max_rows(p.h)
    e_rows, row_sum_max = _abs_rows(E_out)
    out_rows, db, dh_terms = _output_rows(p.g, h_inf, targets, e_rows.astype(p.g.dtype))
    e_max = float(e_rows.max(initial=0))
    if E_in is not E_out:  # tied: one matrix, one pass
        e_max = max(e_max, float(_abs_rows(E_in)[0].max(initial=0)))
    # Each occurrence adds its own |s_in dx[n]|, and dx[n] carries the rounding of dh = g @ E,
    # whose terms can be much larger than their sum (g sums to 0).  Those per-position
    # rounding errors are independent, so they add in quadrature over a token's occurrences:
    # a token seen 1024 times keeps a bound that can still tell a lost occurrence.
    w_inf = float(np.abs(np.asarray(W, dtype=np.float64)).sum(axis=1).max(initial=0.0))
    dx_inf = abs(s_in) * _abs_max_rows(p.dx)
    cancel = abs(s_in) * dh_terms * (abs(res) + w_inf)
    in_rows = np.bincount(tokens, weights=dx_inf, minlength=V)[:V] + np.sqrt(
        np.bincount(tokens, weights=cancel * cancel, minlength=V)[:V])
    b_max = 0.0 if b is None else float(np.abs(b).max(initial=0.0))
    logit = float(h_inf.max(initial=0.0)) * row_sum_max + b_max
    k = d + n + float(np.sqrt(V)) + logit
    x = np.abs(np.asarray(p.x, dtype=np.float64))
    # |du| plus what it can be whatever cancels inside g @ E (so a dW that is 0 in truth, e.g.
    # V = 1, still gets an allowance for the rounding of g)
    du = np.abs(np.asarray(p.du, dtype=np.float64)) + 2.0 / max(n, 1) * e_max
    return Terms(rows=out_rows + in_rows, k=k, loss=logit + abs(p.loss), dW=x.T @ du,
                 db=db if b is not None else None)


def kernel_terms(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Terms:
    """Bound terms of a kernel call: its inputs are given, only its reductions round."""
    rows, _, _ = _output_rows(g, _abs_max_rows(h), np.zeros(0, dtype=np.int64))
    rows = rows + np.bincount(tokens, weights=_abs_max_rows(dx), minlength=V)[:V]
    return Terms(rows=rows, k=float(tokens.shape[0] + np.sqrt(V) + 1))


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
