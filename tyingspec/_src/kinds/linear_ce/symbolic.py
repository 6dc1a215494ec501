"""The ``linear-ce`` contract (see :mod:`linear_ce.reference`) derived with sympy, tiny shapes.

The loss is written entry by entry from the contract and differentiated by sympy; nothing of the
closed form's algebra (softmax, the chain rule's factors) is reused, so the two references check
each other.  The parts that are data rather than calculus enter as symbols fed at evaluation
time: the target as a one-hot row ``Y`` (an ignored token's row is all zeros, so its token weight
``t_i = Y_i . w`` is 0 without a special case), the class weights ``w`` (ones without
``ce_weight``), ``s``, ``eps``, ``lam`` and ``c``.  One token is derived and its compiled
function is fed every token at once (as ``core/symbolic.py`` does): the batch loss is a weighted sum
of the tokens' losses with weights that hold only data, so its derivative is the same weighted
sum of theirs.  One compiled function serves every N, target pattern and option value of a
given structure; functions are cached per (V, d, has_bias, has_softcap) in each process.

The log-sum-exp is written as it reads, without the max shift (a shift is not differentiable
symbolically), so logits must stay moderate (|z| below ~700).  The one case the calculus cannot
give, a mean over zero total weight, is the contract's definition: loss 0, gradients 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp

from tyingspec._src.kinds.linear_ce.reference import CEOptions

#: Largest V * d that compiles in well under a second per options structure.
MAX_SYMBOLIC_ENTRIES = 12


@dataclass(frozen=True)
class SymbolicCE:
    """Loss and gradients from the sympy derivation, float64."""

    loss: float | np.ndarray  # float for mean/sum, [N] for none
    dh: np.ndarray  # [N, d]
    dE: np.ndarray  # [V, d]
    db: np.ndarray | None  # [V], None without a bias


def _matrix(name: str, rows: int, cols: int) -> sp.Matrix:
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}_{j}", real=True))


@functools.cache
def compiled(V: int, d: int, has_bias: bool, has_softcap: bool) -> Callable[..., list[Any]]:
    """Compile (once per structure) one token's loss, weight and gradients as a numpy function.

    Arguments: h (d, one token's row), E (V*d), b (V or empty), Y (V, the token's one-hot
    target), w (V), s, eps, lam, c.  Outputs: l, t = Y . w, dl/dh (d), dl/dE (V*d), dl/db.
    ``h`` and ``Y`` may be fed arrays of length N: every token is then evaluated at once.
    """
    h = _matrix("h", 1, d)
    E = _matrix("E", V, d)
    b = _matrix("b", 1, V) if has_bias else sp.zeros(1, V)
    Y = _matrix("Y", 1, V)
    w = _matrix("w", 1, V)
    s, eps, lam, c = sp.symbols("s eps lam c", real=True)

    z = []
    for v in range(V):
        a = s * (sum(h[0, j] * E[v, j] for j in range(d)) + b[0, v])
        z.append(c * sp.tanh(a / c) if has_softcap else a)
    lse = sp.log(sum(sp.exp(zv) for zv in z))
    z_y = sum(Y[0, v] * z[v] for v in range(V))
    loss = lse - (1 - eps) * z_y - eps * sum(z) / V + lam * lse**2
    weight = sum(Y[0, v] * w[0, v] for v in range(V))
    wrt = list(h) + list(E) + (list(b) if has_bias else [])
    outputs = [loss, weight] + [sp.diff(loss, x) for x in wrt]
    args = [list(h), list(E), list(b) if has_bias else [], list(Y), list(w), s, eps, lam, c]
    fn: Callable[..., list[Any]] = sp.lambdify(args, outputs, modules="numpy", cse=True)
    return fn


def symbolic_linear_ce(
    h: object,
    E: object,
    targets: object,
    b: object | None,
    options: CEOptions,
    grad_output: object | None = None,
) -> SymbolicCE:
    """Loss and gradients of the ``linear-ce`` contract from the sympy derivation (float64).

    Small vocabularies only (V*d <= 12; any N).  The per-token derivatives are combined as the
    reduction says: the weights t_i hold only data, so d(sum_i r_i l_i) = sum_i r_i dl_i with
    r_i = t_i / sum t (mean), t_i (sum) or go_i t_i (none).  For mean and sum a scalar
    ``grad_output`` scales the gradients; for none it is the [N] upstream gradient.
    """
    hh = np.asarray(h, dtype=np.float64)
    EE = np.asarray(E, dtype=np.float64)
    y = np.asarray(targets).reshape(-1).astype(np.int64)
    N, d = hh.shape
    V = EE.shape[0]
    if V * d > MAX_SYMBOLIC_ENTRIES:
        raise ValueError(f"symbolic reference: V*d = {V * d} exceeds {MAX_SYMBOLIC_ENTRIES}; "
                         "use the closed form")
    ignored = y == options.ignore_index
    if np.any(~ignored & ((y < 0) | (y >= V))):
        raise ValueError("a target outside [0, V) that is not ignore_index")
    Y = np.zeros((N, V))
    Y[np.flatnonzero(~ignored), y[~ignored]] = 1.0
    w = np.ones(V) if options.ce_weight is None else np.asarray(options.ce_weight, np.float64)
    bias = None if b is None else np.asarray(b, dtype=np.float64).reshape(-1)
    fn = compiled(V, d, bias is not None, options.softcap is not None)
    flat = fn(list(hh.T), list(EE.reshape(-1)), [] if bias is None else list(bias),
              list(Y.T), list(w), float(options.logit_scale), float(options.label_smoothing),
              float(options.lse_square_scale), float(options.softcap or 1.0))
    # [outputs, N]; an output that does not depend on the token comes back as a scalar
    vals = np.array([np.broadcast_to(np.asarray(v, dtype=np.float64), (N,)) for v in flat])
    per_token, t, grads = vals[0], vals[1], vals[2:]
    red = options.reduction
    # none: one upstream gradient per token; mean and sum: a scalar (1 when not given)
    if grad_output is None:
        go = np.ones(N) if red == "none" else np.asarray(1.0)
    else:
        go = np.asarray(grad_output, np.float64)
    if red == "none":
        loss: float | np.ndarray = t * per_token
        r = go.reshape(N) * t
    elif red == "sum":
        loss = float((t * per_token).sum())
        r = float(go) * t
    elif t.sum() == 0:
        # 0/0 in the expression: the contract defines this case rather than derives it
        loss, r = 0.0, np.zeros(N)
    else:
        loss = float((t * per_token).sum() / t.sum())
        r = float(go) * t / t.sum()
    dh = (grads[:d] * r).T  # token i's row of dh is r_i dl_i/dh_i
    rest = grads[d:] @ r
    dE = rest[: V * d].reshape(V, d)
    db = rest[V * d:].reshape(V) if bias is not None else None
    return SymbolicCE(loss=loss, dh=dh, dE=dE, db=db)
