"""Work on large arrays split over the cores, where numpy runs without the GIL.

numpy's BLAS products use every core, but its elementwise functions, reductions and random
draws use one.  At GPT-2 size a few of them each pass over a 206 MB [N, V] or a 154 MB [V, d]
array (the reference's softmax, the batch's E): on a 2-core machine half of it sits idle while
they run.  :func:`on_cores` runs one function over independent pieces (blocks of rows) on a
pool of threads made for the call and joined before it returns, so no thread outlives it (a
fork after it, by a target or by ``multiprocessing``, copies no idle pool).  Whatever is
split must not depend on how: each piece's result is its own, so the answer is the same on any
number of cores.

The opposite holds beside a worker that is running a call or an import, which wants the cores
too (see ``engine.observe._Building``): there :func:`blas_on_one_core` keeps numpy's BLAS
products to one thread, so that they take what the worker leaves idle and no more.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return max(1, len(affinity(0)) if affinity is not None else (os.cpu_count() or 1))


def on_cores(fn: Callable[[T], None], pieces: Sequence[T]) -> None:
    """``fn`` of every piece, on up to :func:`cores` threads; the first exception is raised."""
    n = min(len(pieces), cores())
    if n <= 1:
        for p in pieces:
            fn(p)
        return
    with ThreadPoolExecutor(max_workers=n) as pool:
        for f in [pool.submit(fn, p) for p in pieces]:
            f.result()


def row_ranges(rows: int, parts: int) -> list[slice]:
    """``rows`` split into at most ``parts`` contiguous ranges of near-equal length."""
    parts = max(1, min(parts, rows))
    edges = [rows * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def on_row_blocks(fn: Callable[[slice], None], rows: int, block: int) -> None:
    """``fn`` of every block of ``block`` rows out of ``rows`` (the last one shorter), the
    blocks shared out over the cores in contiguous runs.  The blocks start at multiples of
    ``block`` on any number of cores, so a result made block by block (a sum over a block's
    rows, a product of one) is the same on every machine."""
    count = -(-rows // block) if rows > 0 else 0

    def run(which: slice) -> None:
        for i in range(which.start, which.stop):
            fn(slice(i * block, min(rows, (i + 1) * block)))

    on_cores(run, row_ranges(count, cores()) if count else [])


def blas_on_one_core() -> AbstractContextManager[Any]:
    """numpy's BLAS products on one thread while the ``with`` block runs, then as before.

    BLAS keeps one thread count for the whole process (OpenBLAS built with pthreads, numpy's
    own), so this holds for every thread of it: meant for work on a thread of its own while
    the rest of the process waits (a product elsewhere meanwhile is slower, never different).
    threadpoolctl sets it, and lets only one thread at a time do so: while another thread
    holds a limit of its own (a user's ``threadpool_limits``), this one leaves the count as
    it is, and so does a BLAS threadpoolctl does not know."""
    from threadpoolctl import threadpool_limits

    limits: AbstractContextManager[Any] = threadpool_limits(limits=1, user_api="blas")
    return limits
