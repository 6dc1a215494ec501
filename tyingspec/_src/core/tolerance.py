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


def least_precise(*dtypes: object) -> Precision:
    """The least precise of ``dtypes`` (``None`` entries ignored); float64 when none."""
    names = [precision_of(d) for d in dtypes if d is not None]
    return max(names, key=lambda n: UNIT_ROUNDOFF[n]) if names else "float64"


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
