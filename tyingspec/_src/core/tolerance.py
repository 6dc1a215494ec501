"""Precision: the rounding-error bound a row of dE is judged against, per precision.

An implementation that computes in precision ``p`` (unit roundoff ``u``) cannot be asked to match
the float64 reference more closely than its own arithmetic allows.  Row ``v`` of dE is a sum of
products; its rounding error is bounded by the sum of the *magnitudes* of those products, times
``u`` and a constant for how long the reductions are (after Higham's ``gamma_k = k u``)::

    a_v   = sum_n (|g[n, v]| + [y_n = v] / N) * max_j |h[n, j]|           output path
          + |s_in| * sum_{n: t_n = v} m_n                                  input path
    bound_v = C * u * (k * a_v + max_w a_w)        C = 2 (implementation + reference)
    k     = d + N + sqrt(V) + L                    reduction lengths + logit magnitude

``m_n`` is ``max_j |dx[n, j]|``; for a model, plus the size of the terms of ``dh = g @ E``
(they cancel: g sums to 0), ``sum_v |g[n, v]| max_j |E[v, j]| * (|res| + ||W||_inf)``, added
in quadrature over a token's occurrences (independent per-position rounding).
``L = max_n ||h_n||_inf * max_v ||E_v||_1 + max|b|`` bounds a logit: a float32 logit is off
by about ``u L``, and the softmax turns that into a relative error of the same size in ``g``.
The ``[y_n = v] / N`` term keeps the bound of a target row above zero when the model already
fits its batch (``g ~ 0``);
``max_w a_w`` is a floor at the scale of the whole gradient (underflow in a saturated softmax).

Entry ``(v, j)`` is within the bound when ``|a - e| <= bound_v + rtol |e|`` with
``rtol = C k u``: both an absolute and a relative part, never a bare ``1e-300``.  The same
terms scaled give the loss, dW and db their tolerances.

Above ``core.paths.SKETCH_ABOVE`` multiply-adds, rows of tokens absent from the batch
(which carry the output path alone) are compared through directions ``z`` (sampled columns
and Gaussian directions): ``|(a - e) . z| <= sum_j |z_j| (bound_v + rtol |e_vj|)``, the
entrywise bound summed the same way (see ``core.paths.Sketch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

Precision = Literal["float64", "float32", "bfloat16", "float16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

#: Unit roundoff (half the machine epsilon) of each precision.
UNIT_ROUNDOFF: dict[Precision, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
#: Implementation and reference each contribute one rounding error.
SAFETY = 2.0
#: The next precision down, for ``precision_limited`` ("within the float32 bound").
LOWER: dict[Precision, Precision] = {"float64": "float32", "float32": "bfloat16",
                                     "float16": "bfloat16"}


def precision_of(dtype: object) -> Precision:
    """The precision of a numpy/ml_dtypes/torch dtype (or its name); float64 when unknown."""
    name = getattr(dtype, "name", None) or str(dtype)
    name = name.removeprefix("torch.")
    if name in UNIT_ROUNDOFF:
        return name
    if name in ("half",):
        return "float16"
    return "float64"


def unit_of(dtype: object) -> float:
    """The unit roundoff of a numpy/ml_dtypes/torch/jax dtype (or its name; float64's when
    unknown or ``None``): what every kind's local tolerance is counted in, instead of its
    framework's own ``finfo(...).eps / 2``."""
    if isinstance(dtype, type):
        # a scalar type (``np.float16``, ``jnp.float32``), not a dtype: its dtype's name
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            pass
    return UNIT_ROUNDOFF[precision_of(dtype)]


#: The smallest positive normal value of each precision (what a framework's ``finfo(...).tiny``
#: says): a floor under a bound built of products that can underflow.
SMALLEST_NORMAL: dict[Precision, float] = {
    "float64": 2.0**-1022,
    "float32": 2.0**-126,
    "float16": 2.0**-14,
    "bfloat16": 2.0**-126,
}


def epsilon_of(dtype: object) -> float:
    """The machine epsilon (twice the unit roundoff, :func:`unit_of`) of ``dtype``: the unit a
    kind's local rule is written in where its bound counts whole ulps (``8 eps``)."""
    return 2 * unit_of(dtype)


def smallest_normal(dtype: object) -> float:
    """The smallest positive normal value of ``dtype`` (float64's when unknown)."""
    return SMALLEST_NORMAL[precision_of(dtype)]


def least_precise(*dtypes: object) -> Precision:
    """The least precise of ``dtypes`` (``None`` entries ignored); float64 when none."""
    names = [precision_of(d) for d in dtypes if d is not None]
    return max(names, key=lambda n: UNIT_ROUNDOFF[n]) if names else "float64"


#: Significand bits of each precision (the implicit bit counted).
SIGNIFICAND_BITS: dict[Precision, int] = {"float64": 53, "float32": 24, "float16": 11,
                                          "bfloat16": 8}
#: Bits of evidence a coarser grid needs before the values on it are taken as computed there:
#: a value computed in the finer precision lands on a grid with ``b`` fewer significand bits
#: by chance about once in ``2**b``, so ``n`` nonzero values all on it have a chance of about
#: ``2**-(n b)`` (3 values from float64 to float32, 5 from float32 to float16).
GRID_EVIDENCE_BITS = 64
#: Values an array is first checked on: a value off the grid ends the check (an array computed
#: in its own dtype almost always shows one among its first values) before a pass over all of
#: it (a [V, d] float64 dE at GPT-2 size is 38.6M values).
_GRID_SAMPLE = 4096
#: Values checked at a time after the sample: the temporaries stay a few MB.
_GRID_BLOCK = 1 << 20


def _off_grid(a: np.ndarray, grid: Precision) -> tuple[bool, int]:
    """Whether some value of the flat float array ``a`` is not exactly a ``grid`` float, and
    how many of its values are nonzero."""
    a = a[np.isfinite(a)]  # inf/NaN are a verdict of their own, never evidence of a dtype
    if grid == "bfloat16":
        # a bfloat16 is a float32 whose low 16 bits are zero (same exponent range)
        f = a.astype(np.float32)
        off = (f.astype(a.dtype) != a) | ((f.view(np.uint32) & np.uint32(0xFFFF)) != 0)
    else:
        off = a.astype(numpy_dtype(grid)).astype(a.dtype) != a
    return bool(off.any()), int(np.count_nonzero(a))


def computed_in(a: np.ndarray) -> Precision | None:
    """The coarsest precision every value of ``a`` is exactly a float of, when that is coarser
    than ``a``'s own dtype and its nonzero values are enough evidence (see
    ``GRID_EVIDENCE_BITS``); None otherwise.  A float32 result returned as float64 has every
    value on the float32 grid, so it was computed (or rounded) there, and is judged at its
    bound there, not at float64's."""
    own = precision_of(a.dtype)
    grids: tuple[Precision, ...] = ("bfloat16", "float16", "float32")
    coarser = [p for p in grids if SIGNIFICAND_BITS[p] < SIGNIFICAND_BITS[own]]
    if not coarser or not a.size:
        return None
    # float16 and bfloat16 arrays are checked in float32, which holds both exactly
    flat = np.asarray(a).reshape(-1)
    for grid in coarser:  # coarsest first
        lost = SIGNIFICAND_BITS[own] - SIGNIFICAND_BITS[grid]
        nonzero = 0
        for s in [0, *range(_GRID_SAMPLE, flat.size, _GRID_BLOCK)]:
            e = min(flat.size, _GRID_SAMPLE if s == 0 else s + _GRID_BLOCK)
            block = flat[s:e]
            if block.dtype not in (np.float32, np.float64):
                block = block.astype(np.float32)
            off, n = _off_grid(block, grid)
            if off:
                break
            nonzero += n
        else:
            if nonzero * lost >= GRID_EVIDENCE_BITS:
                return grid
    return None


def numpy_dtype(precision: Precision) -> np.dtype[Any]:
    """The numpy dtype arrays of a case are built in (bfloat16 from ``ml_dtypes``)."""
    if precision == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(precision)


@dataclass(frozen=True)
class Terms:
    """What the bound of a batch is built from (float64, independent of the precision)."""

    rows: np.ndarray  # [V] a_v
    k: float  # reduction lengths + logit magnitude
    loss: float = 0.0  # magnitude the loss is a difference of
    dW: np.ndarray | None = None  # [d, d] sum of |x| |du|
    db: np.ndarray | None = None  # [V] sum of |g| (+ target counts / N)

    @classmethod
    def from_paths(cls, d_in: np.ndarray, d_out: np.ndarray) -> Terms:
        """A fallback for hand-built paths: the row magnitudes of the paths themselves."""
        a = (np.abs(d_in) + np.abs(d_out)).max(axis=1, initial=0.0)
        return cls(rows=a, k=float(d_in.shape[1] + 1))


def amplification(*factors: float) -> float:
    """How much larger the rounding of ``x dE_in + y dE_out`` (``factors`` x and y) can be
    than that of the sum: a path taken ``x`` times carries ``x`` times its rounding (a logit
    scale left out of the head's backward multiplies the output path, rounding and all, by
    16).  Below 1 the reference's own rounding, which the bound also counts, stays as it is."""
    return max(1.0, *(abs(f) for f in factors))


@dataclass(frozen=True)
class Tolerance:
    """Entry ``a`` matches ``e`` when ``|a - e| <= atol + rtol * |e|``; ``atol`` may be one
    value per row (shape ``[V, 1]``)."""

    atol: float | np.ndarray
    rtol: float
    dtype: str

    def close(self, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.abs(actual - expected) <= self.atol + self.rtol * np.abs(expected)
        return out

    def amplified(self, k: float) -> Tolerance:
        """The bound of a result in which a path entered ``k`` times larger (``k >= 1``, see
        :func:`amplification`): the path's rounding grew with it, so ``atol`` does (``rtol``
        already follows the value)."""
        return self if k == 1 else Tolerance(self.atol * k, self.rtol, self.dtype)

    def rows(self, rows: np.ndarray) -> Tolerance:
        """The tolerance restricted to some rows (per-row atol follows them)."""
        if np.ndim(self.atol) == 0:
            return self
        return Tolerance(np.asarray(self.atol)[rows], self.rtol, self.dtype)

    def describe(self) -> str:
        if np.ndim(self.atol) == 0:
            atol = f"atol={float(self.atol):.3g}"
        else:
            a = np.asarray(self.atol)
            atol = f"atol {float(a.min()):.3g}..{float(a.max()):.3g}" if a.size else "atol -"
        return f"{atol}, rtol={self.rtol:.3g} ({self.dtype} rounding bound)"


def row_tolerance(terms: Terms, precision: Precision) -> Tolerance:
    """The per-row bound of the module docstring for ``precision``."""
    u = UNIT_ROUNDOFF[precision]
    a = np.asarray(terms.rows, dtype=np.float64)
    floor = float(a.max(initial=0.0))
    atol = SAFETY * u * (terms.k * a + floor)
    return Tolerance(atol=atol[:, None], rtol=SAFETY * terms.k * u, dtype=precision)


def value_tolerance(terms: Terms, precision: Precision, magnitude: float | np.ndarray,
                    ) -> Tolerance:
    """Tolerance for another output whose terms' magnitudes are ``magnitude`` (loss, dW, db)."""
    u = UNIT_ROUNDOFF[precision]
    m = np.asarray(magnitude, dtype=np.float64)
    floor = float(m.max(initial=0.0)) if m.size else 0.0
    atol = SAFETY * u * (terms.k * m + floor)
    return Tolerance(atol=atol if atol.ndim else float(atol), rtol=SAFETY * terms.k * u,
                     dtype=precision)


def tolerance_for(dtype: object, *magnitudes: np.ndarray | float | None) -> Tolerance:
    """A flat tolerance for comparing values of ``dtype`` whose size is set by ``magnitudes``:
    ``rtol = 16 u`` and ``atol = rtol * max |magnitude|`` (for arrays without bound terms)."""
    name = precision_of(dtype) if dtype is not None else "float64"
    rtol = 16 * UNIT_ROUNDOFF[name]
    scale = max([float(np.max(np.abs(m))) if np.size(m) else 0.0
                 for m in magnitudes if m is not None] + [0.0])
    return Tolerance(atol=rtol * max(scale, 1e-300), rtol=rtol, dtype=name)
