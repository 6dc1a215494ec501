"""Reference for the ``linear-ce`` kind: a fused linear + cross-entropy loss over a tied matrix.

The contract (what every ``linear-ce`` reference and adapter computes)::

    inputs   h [N, d], E [V, d] (the tied matrix), targets y [N] int, optional bias b [V]
    options  logit_scale s (1.0), softcap c (None), label_smoothing eps (0),
             lse_square_scale lam (z-loss, 0), ignore_index (-100),
             reduction "mean" | "sum" | "none" ("mean"), ce_weight w [V] (None)

    a     = s * (h @ E.T + b)                       (b omitted when None)
    z     = c * tanh(a / c)  if c is set, else a
    lse_i = logsumexp_j z_ij                        (max-shifted: finite at |z| ~ 1e4 in float32)
    l_i   = lse_i - (1 - eps) * z[i, y_i] - eps * mean_j z_ij + lam * lse_i**2
    t_i   = w[y_i] (1 without ce_weight) if y_i != ignore_index, else 0
            (an ignored target may lie outside [0, V); any other target must lie inside)

    mean  L = sum_i t_i l_i / sum_i t_i; when sum_i t_i == 0 (every token ignored, or every
          present class weighted 0) the result is defined as L = 0 with every gradient 0
    sum   L = sum_i t_i l_i
    none  L_i = t_i l_i, a vector [N] (exactly 0 for ignored tokens); the gradients are those of
          sum_i go_i L_i for a supplied grad_output go [N] (ones when not given)

    returns loss (float, or [N] for none), dh [N, d], dE [V, d], db [V] (None when b is None)

``t_i`` multiplies the whole per-token loss, smoothing and z-loss terms included (PyTorch's
``cross_entropy`` weights the smoothing term per class instead; this contract does not).  For
mean and sum a scalar ``grad_output`` may be given: the gradients are then those of ``go * L``.

Everything is plain numpy in the requested dtype, blocked over N so that at most the returned
``dz`` [N, V] and a few block-sized temporaries are alive (V = 50257, N = 1024 is fine).

``VARIANTS`` are the known bugs of fused kernels, each the same computation with one thing wrong,
so that a diagnosis can name the bug a wrong gradient matches.  Each equals the correct result
where its bug cannot show (``scale_dropped`` at s = 1, ``z_loss_missing`` at lam = 0, ...).  In
``ignored_not_zeroed`` an ignored token takes token weight 1 under the reduction's own
normalisation (1 / sum t for mean, go_i for none).  A mean over zero total weight returns the
defined 0 in every variant: it is part of the contract, not of the bugs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from tyingspec._src.core.paths import OutputPath

Array = NDArray[np.floating[Any]]
Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")
DTYPES: tuple[str, ...] = ("float64", "float32")

#: Entries of a [rows, V] block: ~4M (32 MB in float64) keeps each block temporary small while
#: the matrix products stay large enough to run at BLAS speed.
_BLOCK_ENTRIES = 1 << 22


@dataclass(frozen=True)
class CEOptions:
    """Options of the fused linear cross-entropy (see the module docstring for their meaning)."""

    logit_scale: float = 1.0
    softcap: float | None = None
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    ce_weight: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap!r}")

    def nondefault(self) -> dict[str, object]:
        """The options that differ from their defaults, by field name."""
        default = CEOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def describe(self) -> str:
        """One line naming the non-default options (``"defaults"`` when there are none)."""
        parts = []
        for name, value in self.nondefault().items():
            if name == "ce_weight" and value is not None:
                parts.append(f"ce_weight[{len(value)}]")  # type: ignore[arg-type]
            else:
                parts.append(f"{name}={value}")
        return " ".join(parts) if parts else "defaults"


@dataclass(frozen=True)
class CEResult:
    """Loss and gradients of one call, all in the computation's dtype except the bound terms."""

    loss: float | np.ndarray  # float for mean/sum, [N] for none
    dh: np.ndarray  # [N, d]
    dE: np.ndarray | OutputPath  # [V, d]; its factors dz.T @ h when asked for (``factored``)
    db: np.ndarray | None  # [V], None without a bias
    # [N, V] dL/d(h @ E.T + b): the gradient w.r.t. the pre-scale logits, i.e. what multiplies
    # h (giving dE = dz.T @ h) and E (giving dh = dz @ E); s and the softcap are already in it
    dz: np.ndarray
    # Magnitudes for rounding bounds (float64): per row v of dE, sum_i |dz_iv| max_j |h_ij|;
    # per row i of dh, sum_v |dz_iv| max_j |E_vj|.  They are the sizes of the terms summed,
    # which can be far larger than the sums (softmax rows sum to ~0).
    dE_terms: np.ndarray  # [V]
    dh_terms: np.ndarray  # [N]
    # per row i of dh, the target entry's share of dh_terms: where the softmax is saturated at
    # the target, dz_iy = p - 1 ~ 0 is still rounded at 1, and this is what that costs dh
    dh_target_terms: np.ndarray  # [N]
    db_terms: np.ndarray  # [V] per entry of db: sum_i of the magnitudes of dz's terms
    # With directions Z [d, k]: dE @ Z and its magnitudes, the same terms' sizes times
    # |h| @ |Z| ([V, k] float64 each; what a ``core.paths.Sketch`` judges rows through)
    projected: tuple[np.ndarray, np.ndarray] | None = None


#: Known-wrong variants: name -> (diagnosis label, one-line description).
VARIANTS: dict[str, tuple[str, str]] = {
    "scale_dropped": (
        "logit_scale_dropped",
        "the backward drops the logit scale s (dz not multiplied by s); the loss is right "
        "(unsloth-zoo PR #930: a 0.0625 scale dropped makes the tied gradient 16x too large)"),
    "scale_twice": (
        "logit_scale_twice",
        "the backward multiplies by the logit scale s twice; the loss is right"),
    "softcap_derivative_missing": (
        "softcap_derivative_missing",
        "the backward omits the softcap's factor 1 - tanh(a/c)**2; the loss is right"),
    "smoothing_misweighted": (
        "label_smoothing_misweighted",
        "the backward weights the target term 1 instead of 1 - eps; the loss is right"),
    "z_loss_missing": (
        "z_loss_missing",
        "the forward includes the z-loss but the backward omits its 2*lam*lse_i*softmax_i"),
    "ignored_counted": (
        "ignored_counted_in_mean",
        "mean divides by sum_i t_i plus the number of ignored tokens; loss and gradients both "
        "(ROCm TransformerEngine PR #336)"),
    "ignored_not_zeroed": (
        "ignored_not_zeroed",
        "ignored tokens add the gradient of their lse_i (softmax, no target term) with token "
        "weight 1 (under the reduction's 1/sum t or go_i) to dh, dE and db; the loss is right "
        "(Liger #968)"),
    "grad_output_first": (
        "grad_output_broadcast",
        "reduction none scales every token's gradient by grad_output[0] instead of its own "
        "(Liger PR #1298); the loss is right"),
}


def _validate(h: Array, E: Array, y: NDArray[np.integer[Any]], b: Array | None,
              options: CEOptions) -> None:
    if h.ndim != 2 or E.ndim != 2 or h.shape[1] != E.shape[1] or E.shape[0] == 0:
        raise ValueError(f"h [N, d] and E [V >= 1, d] expected, got {h.shape} and {E.shape}")
    N, V = h.shape[0], E.shape[0]
    if y.shape != (N,):
        raise ValueError(f"targets must have shape ({N},), got {y.shape}")
    if b is not None and b.shape != (V,):
        raise ValueError(f"b must have shape ({V},), got {b.shape}")
    live = y != options.ignore_index
    if np.any(live & ((y < 0) | (y >= V))):
        bad = sorted(set(y[live & ((y < 0) | (y >= V))].tolist()))
        raise ValueError(f"targets {bad} are outside [0, {V}) and not ignore_index "
                         f"({options.ignore_index})")
    if options.ce_weight is not None and len(options.ce_weight) != V:
        raise ValueError(f"ce_weight has {len(options.ce_weight)} entries, V = {V}")


def _softcap(a: Array, c: float) -> tuple[Array, Array]:
    """z = c tanh(a/c) and its derivative sech^2(a/c), both accurate for every a.

    The derivative is written as 4e/(1+e)^2 with e = exp(-2|x|) rather than 1 - tanh^2: near
    saturation 1 - tanh^2 cancels to nothing in float32 while this form keeps full precision.
    """
    x = a / a.dtype.type(c)
    e = np.exp(-2 * np.abs(x))
    deriv = 4 * e / ((1 + e) * (1 + e))
    z = np.tanh(x, out=x)
    z *= a.dtype.type(c)
    return z, deriv


def linear_ce(
    h: object,
    E: object,
    targets: object,
    b: object | None,
    options: CEOptions,
    grad_output: object | None = None,
    *,
    variant: str | None = None,
    dtype: str = "float64",
    block_rows: int | None = None,
    Z: Array | None = None,
    factored: bool = False,
    lanes: tuple[int, float] = (0, 0.0),
) -> CEResult:
    """Closed-form loss and gradients of the contract in the module docstring.

    ``variant`` (a key of :data:`VARIANTS`) returns what that known-wrong kernel returns instead.
    ``dtype`` ("float64" or "float32") is the arithmetic and output dtype.  ``block_rows`` sets
    how many tokens are processed at once (default: from V, to bound memory); it changes only
    the grouping, never the result beyond rounding.  ``Z [d, k]`` adds the projections of dE
    and their magnitudes (``projected``); ``factored`` returns dE as its factors ``dz.T @ h``
    (an :class:`~tyingspec._src.core.paths.OutputPath`: at Llama-3's head the [V, d] matrix is
    2.1 GB in float32, and a check reads it a block of rows at a time).  ``lanes = (P, zp)``
    adds P phantom logits of value zp to every token's logsumexp (and so to its softmax's
    denominator): what a kernel computes whose padded vocabulary lanes (past V in its last
    block) leak into it, as a softcap of the -inf they were masked with does (-softcap).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    dt = np.dtype(dtype)
    one = dt.type(1)
    hh: Array = np.asarray(h, dtype=dt)
    EE: Array = np.asarray(E, dtype=dt)
    bb: Array | None = None if b is None else np.asarray(b, dtype=dt).reshape(-1)
    y = np.asarray(targets).reshape(-1).astype(np.int64)
    _validate(hh, EE, y, bb, options)
    N, d = hh.shape
    V = EE.shape[0]
    red = options.reduction
    s = dt.type(options.logit_scale)
    eps = dt.type(options.label_smoothing)
    lam = dt.type(options.lse_square_scale)

    ignored = y == options.ignore_index
    y_safe = np.where(ignored, 0, y)  # an ignored target may be out of range: never index by it
    w = (np.ones(V, dtype=dt) if options.ce_weight is None
         else np.asarray(options.ce_weight, dtype=dt))
    t = np.where(ignored, dt.type(0), w[y_safe]).astype(dt)  # token weights, 0 when ignored
    total = t.sum(dtype=dt)
    n_ignored = dt.type(int(ignored.sum()))

    # go: the upstream gradient per token (none) or one scalar (mean/sum)
    if red == "none":
        go = (np.ones(N, dtype=dt) if grad_output is None
              else np.asarray(grad_output, dtype=dt).reshape(-1))
        if go.shape != (N,):
            raise ValueError(f"grad_output for reduction none must have shape ({N},)")
        if variant == "grad_output_first" and N:
            go = np.full(N, go[0], dtype=dt)
        coef = go * t  # dL/dl_i
        unit = go  # what an ignored token would get with token weight 1
    else:
        g0 = one if grad_output is None else np.asarray(grad_output, dtype=dt)
        if np.ndim(g0) != 0:
            raise ValueError(f"grad_output for reduction {red} must be a scalar")
        g = dt.type(g0)
        if red == "sum":
            coef, unit = g * t, np.full(N, g, dtype=dt)
        else:
            denom = total + n_ignored if variant == "ignored_counted" else total
            # sum t_i == 0: the defined result is 0 (not 0/0); also what the variants return
            inv = one / denom if denom != 0 else dt.type(0)
            coef, unit = g * inv * t, np.full(N, g * inv, dtype=dt)

    target_w = one if variant == "smoothing_misweighted" else one - eps
    if variant == "scale_dropped":
        chain = one
    elif variant == "scale_twice":
        chain = s * s
    else:
        chain = s

    bound_coef = np.abs(coef) if variant != "ignored_not_zeroed" else \
        np.maximum(np.abs(coef), np.abs(unit))
    if not bound_coef.any():
        # Every token weighs 0 (all ignored, or grad_output 0): the gradients are exactly 0 and
        # a correct kernel's softmax x 0 rounds nothing, but a bound of 0 would make any error
        # an infinite multiple of it.  Bound it as tokens of weight 1/N: ~u of what the
        # smallest real gradient would be, far below any bug's.
        bound_coef = np.full(N, one / dt.type(max(N, 1)), dtype=dt)
    dz = np.empty((N, V), dtype=dt)
    per_token = np.zeros(N, dtype=dt)
    dE_terms = np.zeros(V)
    dh_terms = np.zeros(N)
    dh_target_terms = np.zeros(N)
    db_terms = np.zeros(V)
    h_max = np.abs(hh).max(axis=1, initial=0).astype(dt)
    E_max = np.abs(EE).max(axis=1, initial=0).astype(dt)
    rows = block_rows or max(1, _BLOCK_ENTRIES // max(V, 1))
    if Z is not None:
        # in dz's own dtype, as the whole product dz.T @ h would be (see core.paths.Sketch)
        hz = (np.asarray(hh, np.float64) @ Z).astype(dt)
        habs_z = np.abs(np.asarray(hh, np.float64)) @ np.abs(Z)
        proj = np.zeros((V, Z.shape[1]))
        proj_mag = np.zeros((V, Z.shape[1]))
    for lo in range(0, N, rows):
        hi = min(N, lo + rows)
        r = np.arange(hi - lo)
        zb: Array = hh[lo:hi] @ EE.T
        if bb is not None:
            zb += bb
        zb *= s
        deriv: Array | None = None
        if options.softcap is not None:
            zb, deriv = _softcap(zb, options.softcap)
        m = zb.max(axis=1)
        if lanes[0]:
            m = np.maximum(m, dt.type(lanes[1]))
        p = np.exp(zb - m[:, None])
        ssum = p.sum(axis=1)
        if lanes[0]:
            ssum += dt.type(lanes[0]) * np.exp(dt.type(lanes[1]) - m)
        lse = m + np.log(ssum)
        z_y = zb[r, y_safe[lo:hi]]
        z_mean = zb.mean(axis=1)
        per_token[lo:hi] = lse - (one - eps) * z_y - eps * z_mean + lam * lse * lse
        del zb
        p /= ssum[:, None]  # softmax
        # the bound's terms: the magnitudes of what dl/dz is a sum of (softmax, target weight,
        # eps/V), before they cancel, times the same factors as dl/dz; and before the softcap's
        # factor, whose 1 - tanh**2 a kernel computes with an absolute error ~u where it cancels
        mag = p * np.abs(one + 2 * lam * lse)[:, None]
        mag[r, y_safe[lo:hi]] += abs(target_w)
        mag += abs(eps) / dt.type(V)
        mag *= bound_coef[lo:hi, None]
        mag *= abs(chain)
        softmax_dead = p[ignored[lo:hi]] if variant == "ignored_not_zeroed" else None
        # dl_i/dz_ij = softmax_ij (1 + 2 lam lse_i) - (1 - eps)[j = y_i] - eps / V
        if variant != "z_loss_missing":
            p *= (one + 2 * lam * lse)[:, None]
        live = ~ignored[lo:hi]
        p[r[live], y_safe[lo:hi][live]] -= target_w
        p -= eps / dt.type(V)
        p *= coef[lo:hi, None]
        if variant == "ignored_not_zeroed" and not live.all():
            # the ignored rows were scaled by t_i = 0 above; give them softmax x weight 1
            dead = ~live
            assert softmax_dead is not None
            p[dead] = softmax_dead * unit[lo:hi][dead, None]
        if deriv is not None and variant != "softcap_derivative_missing":
            p *= deriv
        p *= chain
        dz[lo:hi] = p
        dE_terms += (mag.T @ h_max[lo:hi]).astype(np.float64)
        dh_terms[lo:hi] = mag @ E_max
        dh_target_terms[lo:hi] = mag[r, y_safe[lo:hi]] * E_max[y_safe[lo:hi]]
        db_terms += mag.sum(axis=0).astype(np.float64)
        if Z is not None:
            proj += p.T @ hz[lo:hi]
            # |dz| <= mag entrywise, so this bounds sum_j |Z[j, q]| |dE[v, j]|
            proj_mag += np.asarray(mag, np.float64).T @ habs_z[lo:hi]
        del p, mag

    if red == "none":
        loss: float | np.ndarray = np.where(ignored, dt.type(0), t * per_token).astype(dt)
    elif red == "sum":
        loss = float((t * per_token).sum(dtype=dt))
    else:
        denom = total + n_ignored if variant == "ignored_counted" else total
        loss = float((t * per_token).sum(dtype=dt) / denom) if denom != 0 else 0.0
    dh = dz @ EE
    dE: np.ndarray | OutputPath = OutputPath(dz, hh) if factored else dz.T @ hh
    db = dz.sum(axis=0, dtype=dt) if bb is not None else None
    return CEResult(loss=loss, dh=dh, dE=dE, db=db, dz=dz, dE_terms=dE_terms,
                    dh_terms=dh_terms, dh_target_terms=dh_target_terms, db_terms=db_terms,
                    projected=None if Z is None else (proj, proj_mag))
