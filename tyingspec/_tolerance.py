"""Tolerances keyed by dtype (after jax's public_test_util): both atol and rtol, always.

``rtol`` comes from the table for the lower-precision dtype involved; ``atol`` is ``rtol`` times
the magnitude of the quantities being compared, so an entry that should be ~0 next to entries of
size 1 is judged on the scale of the whole gradient, not on its own (relative-only would call
1e-17 vs 0 infinitely wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Agreement we demand between an implementation and the float64 closed-form reference.
_RTOL: dict[str, float] = {
    "float64": 1e-9,
    "float32": 2e-4,
    "float16": 2e-2,
    "bfloat16": 5e-2,
}
_TINY = 1e-300


def _dtype_name(dtype: object) -> str:
    name = getattr(dtype, "name", None) or str(dtype)
    return name if name in _RTOL else "float64"


def least_precise(*dtypes: object) -> str:
    names = [_dtype_name(d) for d in dtypes if d is not None]
    return max(names, key=lambda n: _RTOL[n]) if names else "float64"


@dataclass(frozen=True)
class Tolerance:
    """Entry ``a`` matches ``e`` when ``|a - e| <= atol + rtol * |e|``."""

    atol: float
    rtol: float
    dtype: str

    def close(self, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.abs(actual - expected) <= self.atol + self.rtol * np.abs(expected)
        return out

    def describe(self) -> str:
        return f"atol={self.atol:.3g}, rtol={self.rtol:.3g} ({self.dtype})"


def tolerance_for(dtype: object, *magnitudes: np.ndarray | float | None) -> Tolerance:
    """Tolerance for comparing values of ``dtype`` whose natural size is set by ``magnitudes``."""
    name = _dtype_name(dtype) if dtype is not None else "float64"
    rtol = _RTOL[name]
    scale = max([float(np.max(np.abs(m))) if np.size(m) else 0.0
                 for m in magnitudes if m is not None] + [0.0])
    return Tolerance(atol=rtol * scale + _TINY, rtol=rtol, dtype=name)
