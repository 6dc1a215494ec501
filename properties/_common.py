"""What the property checks share: calling an adapter on a case, the reference, the tolerance.

Not a property module: nothing here registers.  The tolerance of a comparison follows the least
precise of the case's dtype and the dtypes the adapter returned, so a float32 implementation is
judged at float32 whatever it was given (the README's contract), and the reference is always
float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tyingspec._adapters import ModelOutput, call_kernel, call_model
from tyingspec._cases import Batch, Case, kernel_inputs
from tyingspec._diagnosis import ArrayCheck, Diagnosis, compare, diagnose
from tyingspec._probe import Array, IntArray, Parts, Paths
from tyingspec._tolerance import Tolerance, least_precise, tolerance_for

Adapter = Callable[..., Any]


def judged_dtype(case: Case, *returned: Any) -> str:
    """The dtype a comparison is judged at: the least precise of the case's and the outputs'."""
    return least_precise(case.dtype, *[np.asarray(a).dtype for a in returned if a is not None])


def concrete(case: Case, batch: Batch) -> Case:
    """The case with its tokens and targets spelled out: what a failure prints and replays."""
    return case.with_batch(batch.tokens, batch.targets)


def run_model(spec: str, fn: Adapter, batch: Batch, *, E: Array | None = None,
              b: Array | None | str = "same", tokens: IntArray | None = None,
              targets: IntArray | None = None) -> ModelOutput:
    """Call a model adapter on ``batch``, with any of E, b, tokens, targets replaced."""
    return call_model(spec, fn, batch.E if E is None else E, batch.W,
                      batch.b if isinstance(b, str) else b,
                      batch.tokens if tokens is None else tokens,
                      batch.targets if targets is None else targets,
                      res=batch.res, s_in=batch.s_in)


@dataclass(frozen=True)
class KernelInputs:
    """The four arrays a kernel adapter receives, taken from a real forward pass."""

    tokens: IntArray
    dx: Array
    h: Array
    g: Array
    V: int

    def call(self, spec: str, fn: Adapter, **replace: Any) -> tuple[np.ndarray, tuple[str, ...]]:
        a = {"tokens": self.tokens, "dx": self.dx, "h": self.h, "g": self.g} | replace
        return call_kernel(spec, fn, a["tokens"], a["dx"], a["h"], a["g"], self.V)


def kernel_case(batch: Batch) -> tuple[KernelInputs, Parts, Paths]:
    """Kernel inputs of a batch (in the case's dtype) and the float64 reference paths."""
    parts, paths = kernel_inputs(batch)
    return (KernelInputs(batch.tokens, parts.input_rows, parts.h, parts.g, batch.E.shape[0]),
            parts, paths)


def path_tolerance(paths: Paths, dtype: str, scale: float = 0.0) -> Tolerance:
    """The tolerance :func:`tyingspec.diagnose` uses for dE on these paths."""
    return tolerance_for(dtype, paths.dE, paths.dE_in, paths.dE_out, scale)


def agree(a: Any, e: Any, dtype: str, *magnitudes: Any) -> np.ndarray:
    """Entrywise ``|a - e| <= atol + rtol |e|`` with atol scaled to the compared magnitudes."""
    a64, e64 = np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64)
    tol = tolerance_for(dtype, a64, e64, *[np.asarray(m, dtype=np.float64) for m in magnitudes])
    return np.asarray(tol.close(a64, e64))


def natural_scales(batch: Batch) -> dict[str, float]:
    """Bounds on the size of dE, the loss, dW and db that hold whatever cancels inside them.

    With mean cross-entropy, sum_n |g[n, v]| <= 2 and sum_v |g[n, v]| <= 2/N, so
    |dE_out| <= 2 max|h|, |dE_in| <= 2 |s_in| max|E| (|res| + ||W||_inf),
    |dW| <= 2 max|x| max|E| and |db| <= 2; the loss is a difference of logits, so
    max|logit| <= d max|h| max|E| + max|b| bounds its rounding.  Anchoring atol on these (not
    on the reference value alone) keeps a gradient that is ~0 in truth (V = 1, or a batch the
    model already fits: g ~ 0) from being called wrong for float32 rounding of
    softmax - onehot, and makes such an example powerless rather than evidence."""
    E = np.abs(batch.E.astype(np.float64))
    e_max = float(E.max(initial=0.0))
    x = abs(batch.s_in) * (float(E[batch.tokens].max(initial=0.0)) if batch.tokens.size else 0.0)
    h = abs(batch.res) * x + 1.0  # |tanh| <= 1
    w = float(np.abs(batch.W.astype(np.float64)).sum(axis=1).max(initial=0.0))
    b = 0.0 if batch.b is None else float(np.abs(batch.b).max(initial=0.0))
    return {"dE": 2.0 * h + 2.0 * abs(batch.s_in) * e_max * (abs(batch.res) + w),
            "loss": batch.E.shape[1] * h * e_max + b, "dW": 2.0 * x * e_max, "db": 2.0}


def dE_scale(batch: Batch) -> float:
    """The ``scale`` to pass to :func:`tyingspec.diagnose` for this batch."""
    return natural_scales(batch)["dE"]


def other_checks(out: ModelOutput, paths: Paths, dtype: str,
                 batch: Batch | None = None) -> list[ArrayCheck]:
    """loss, dW and db of a model output against the reference (both atol and rtol); with
    ``batch``, atol is also anchored on :func:`natural_scales`."""
    s = natural_scales(batch) if batch is not None else {"loss": 0.0, "dW": 0.0, "db": 0.0}
    checks = [compare("loss", out.loss, paths.loss, tolerance_for(dtype, paths.loss, s["loss"])),
              compare("dW", out.dW, paths.dW, tolerance_for(dtype, paths.dW, s["dW"]))]
    if paths.db is not None and out.db is not None:
        checks.append(compare("db", out.db, paths.db, tolerance_for(dtype, paths.db, s["db"])))
    return checks


def power_of(paths: Paths, dtype: str, batch: Batch) -> Diagnosis:
    """The diagnosis of the reference itself: its ``power`` says what this example can catch."""
    return diagnose(paths.dE, paths, dtype=dtype, scale=dE_scale(batch))


def rows_text(rows: Any, limit: int = 16) -> str:
    rows = [int(r) for r in rows]
    return "[" + ", ".join(map(str, rows[:limit])) + (", ..." if len(rows) > limit else "") + "]"


def seeded(case: Case, salt: int) -> np.random.Generator:
    """A generator for a property's own random choices, reproducible from the case's seed."""
    return np.random.default_rng([case.seed, salt])
