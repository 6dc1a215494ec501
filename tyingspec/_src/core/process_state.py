"""A kind's call leaves the process it ran in as it found it.

A built-in target runs in the checking process, whose torch and JAX are the user's (a pytest
worker that runs a check, then the user's own tests).  A call sets what it needs for itself:
the torch kinds one thread, a seeded global RNG and (the distributed kind's reference) float64
as torch's default dtype; the jax kind JAX's float64 (``jax_enable_x64``).  Left set, a model
the user builds after a check came out float64, or with other random weights (seen: a
transformers model's gradient check in the same pytest worker failed by 1.4e-6).  A target run
in a worker changes only the worker.  torch and JAX are imported when a call needs them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["WORKER_ENV", "in_worker", "jax_state_kept", "torch_state_kept"]

#: Set in the environment of the worker process a target runs in (``engine.isolation.launch``):
#: a process-wide setting that would outlive a check in the user's own process may be made
#: there and only there.
WORKER_ENV = "TYINGSPEC_WORKER"


def in_worker() -> bool:
    """Whether this process is a worker tyingspec started for a target (not the user's)."""
    return os.environ.get(WORKER_ENV) == "1"


@contextlib.contextmanager
def torch_state_kept() -> Iterator[None]:
    """torch's default dtype, thread count and CPU global RNG state, put back on the way out."""
    import torch

    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)


@contextlib.contextmanager
def jax_state_kept() -> Iterator[None]:
    """JAX's ``jax_enable_x64``, put back on the way out."""
    import jax

    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", x64)  # type: ignore[no-untyped-call]
