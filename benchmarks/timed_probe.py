"""``torch_probe.tied_f32`` with its calls timed inside the worker, for ``bench_warm_timeline``.

    tyingspec check benchmarks.timed_probe:tied_f32 --precision float32   # a correct model

Each call appends one line to the file named by ``TYINGSPEC_BENCH_LOG`` (nothing without it):
the call's start and end on the monotonic clock (``time.perf_counter``, the same clock in
every process of the machine), its positions, and the CPU seconds it used.  Imported in the
worker, it also times the worker's own steps after the call, making the result block and
writing dE into it (``engine.isolation._create`` and ``_write_result``): a benchmark's wrapper, so
that the time between the implementation's return and the answer is seen, not guessed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.torch_probe import Result
from benchmarks.torch_probe import tied_f32 as _tied_f32

LOG = os.environ.get("TYINGSPEC_BENCH_LOG")


def _log(label: str, start: float, end: float, cpu: float) -> None:
    if LOG:
        with open(LOG, "a") as fh:
            fh.write(f"{label} {start:.6f} {end:.6f} {cpu:.4f}\n")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def tied_f32(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
             targets: np.ndarray, *, res: float, s_in: float) -> Result:
    """``torch_probe.tied_f32``, timed."""
    c0, t0 = _cpu(), time.perf_counter()
    out = _tied_f32(E, W, b, tokens, targets, res=res, s_in=s_in)
    _log(f"call[N={np.asarray(tokens).size}]", t0, time.perf_counter(), _cpu() - c0)
    return out


def _timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        c0, t0 = _cpu(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _log(label, t0, time.perf_counter(), _cpu() - c0)
    return wrapper


if LOG:
    import tyingspec._src.engine.isolation as _iso

    _iso._create = _timed("worker: result block made", _iso._create)  # type: ignore[assignment]
    _iso._write_result = _timed(  # type: ignore[assignment]
        "worker: dE written into it", _iso._write_result)
