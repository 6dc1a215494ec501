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

    @property
    def dE(self) -> Array:
        return self.dE_in + self.dE_out


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
    logits = h @ E_out.T
    if b is not None:
        logits = logits + b
    shift = logits - logits.max(axis=1, keepdims=True)
    logz = np.log(np.exp(shift).sum(axis=1, keepdims=True))
    logp = shift - logz
    loss = float(-logp[np.arange(n), targets].mean())
    g = np.exp(logp)
    g[np.arange(n), targets] -= 1
    g /= dt.type(n)
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
    )


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
