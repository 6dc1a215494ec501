"""Large arrays with their pages faulted in by one ``madvise``.

On a VM, touching a fresh 154 MB mapping page by page costs 0.3-0.4 s of page faults (a
GPT-2-size E); asking the kernel to populate it costs ~0.05 s.  A check at production size
makes a few such arrays (E, the reference's logits, E after the SGD step, the shared blocks
to and from the worker): each is made here.  Where the advice is unknown (not Linux, a kernel
before 5.14) the pages fault in on first use, as they would anyway.

A mapping whose last array has gone is kept for the next array of about its size (up to
``POOL_BYTES`` in all): a warm check (the Python API's, the pytest plugin's) makes the same
few arrays case after case, and a mapping taken again has its pages in already, where a new
one costs its populating and the old one its unmapping, on the case's critical path.
"""

from __future__ import annotations

import math
import mmap
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

#: ``madvise`` advice (Linux 5.14+) that maps a whole mapping in with one call.
_POPULATE_READ, _POPULATE_WRITE = 22, 23
#: Below this many bytes an array comes from numpy's allocator: its memory is likely warm.
POPULATE_ABOVE = 16 << 20


def populate(mapping: Any, *, write: bool) -> None:
    """Fault in ``mapping`` (an ``mmap``, or a shared-memory block's) with one ``madvise``."""
    advise = getattr(getattr(mapping, "_mmap", mapping), "madvise", None)
    if advise is None or not sys.platform.startswith("linux"):
        return
    try:
        advise(_POPULATE_WRITE if write else _POPULATE_READ)
    except (OSError, ValueError):
        pass


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)``, its pages faulted in at once when it is large: the array
    holds a private anonymous mapping, kept for a later array once the array and every view of
    it have gone (see ``POOL_BYTES``)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < POPULATE_ABOVE or not sys.platform.startswith("linux"):
        return np.empty(shape, dtype=dt)
    mapping = _pooled(nbytes)
    if mapping is None:
        # Private, not mmap's default shared mapping: shared anonymous memory is shmem, whose
        # pages cost more to populate (a warm case's three such arrays at GPT-2 size:
        # 0.31-0.39 s shared, 0.17-0.20 s private).  Not huge pages (as numpy asks for its
        # own): beside a worker whose allocations fragment memory, populating them stalled on
        # compaction for 0.2-0.4 s an array.
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        populate(mapping, write=True)
    return leased(mapping, shape, dt, _kept)


#: Bytes of mappings kept, in all, for arrays to come (see :func:`empty`): a warm case at
#: GPT-2 size makes three (E, the reference's logits, E after the step: 0.5 GB), and took
#: 0.12 s and 0.19 s less with them kept (2 runs of 8 and 10 interleaved pairs in one process
#: on the 2-core VM of docs/speed.md, 8 of 8 and 9 of 10 faster).  A larger mapping is
#: unmapped as it goes (at Llama-3's head E alone is 2.1 GB), and every kept one is unmapped
#: before a new mapping is made: what is kept is at most what the last case made.  The cold
#: command gains nothing (each of its arrays is made once) and keeps nothing longer than the
#: process.
POOL_BYTES = 1 << 30
_FREE: list[mmap.mmap] = []
_POOL_LOCK = threading.RLock()  # a lease can go on any thread, in a collection inside this


def _pooled(nbytes: int) -> mmap.mmap | None:
    """The smallest kept mapping of ``nbytes`` up to twice that, taken out of the pool; when
    none fits, None, and the pool emptied (its mappings unmapped) before a new one is made."""
    with _POOL_LOCK:
        fits = [m for m in _FREE if nbytes <= len(m) <= 2 * nbytes]
        if not fits:
            _FREE.clear()
            return None
        best = min(fits, key=len)
        _FREE.remove(best)
        return best


def _kept(mapping: mmap.mmap) -> None:
    """Keep the mapping of an array of :func:`empty` that has gone, within ``POOL_BYTES``."""
    with _POOL_LOCK:
        if len(mapping) + sum(len(m) for m in _FREE) <= POOL_BYTES:
            _FREE.append(mapping)


def drop_pool() -> None:
    """Unmap every kept mapping (see ``POOL_BYTES``)."""
    with _POOL_LOCK:
        _FREE.clear()


def leased(mapping: mmap.mmap, shape: tuple[int, ...], dtype: Any,
           give_back: Callable[[mmap.mmap], None]) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` at the start of ``mapping`` (its pages already
    in), which holds the mapping until the array and every view of it have gone; then
    ``give_back(mapping)`` (the pool here, a worker's result blocks in ``engine.isolation``;
    a mapping it keeps no reference to is unmapped)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if len(mapping) < nbytes:
        raise ValueError(f"a mapping of {len(mapping)} bytes for an array of {nbytes}")
    if dt.str[1:2] == "V":
        # a dtype numpy names by no type string of its own (bfloat16's is '<V2'): the bytes
        # first, then the dtype, which a view keeps and an __array_interface__ does not
        flat = np.asarray(_Lease(mapping, (nbytes,), np.dtype(np.uint8), give_back))
        out: np.ndarray = flat.view(dt).reshape(shape)
        return out
    return np.asarray(_Lease(mapping, tuple(shape), dt, give_back))


class _Lease:
    """The base of an array of :func:`leased` (and so of every view of it): it holds the
    mapping, and the buffer export that gives its address, and hands the mapping to its
    ``give_back`` when the last array over it goes, which no weak reference to the array
    could tell (a view outlives the array it was taken from)."""

    def __init__(self, mapping: mmap.mmap, shape: tuple[int, ...], dt: np.dtype[Any],
                 give_back: Callable[[mmap.mmap], None]) -> None:
        self._mapping = mapping
        self._give_back = give_back
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)  # the export: mapped while held
        self.__array_interface__ = {"shape": shape, "typestr": dt.str, "version": 3,
                                    "data": (self._bytes.ctypes.data, False)}

    def __del__(self) -> None:
        try:
            self._give_back(self._mapping)
        except Exception:  # noqa: BLE001  (interpreter shutdown: the mapping just goes)
            pass


def unshared(a: np.ndarray, holders: int) -> bool:
    """Whether nothing but the ``holders`` references the caller counts can reach ``a``'s
    memory: it owns its buffer (not a view of one an adapter may keep), no weak reference to it
    exists, and its reference count is exactly ``holders``.  Such an array cannot be written
    by whoever made it, so it can be kept as it is where a copy was made "in case the adapter
    reuses its buffer" (a [V, d] copy is 2.1 GB at Llama-3's head).  Anything uncertain says
    False (a copy stays the safe answer): an array that is a view, a memory-mapped one, and
    interpreters whose counts can be lower than the references (3.14 borrows references on
    the stack).  An array of :func:`leased`'s owns its memory as much, when it is the array
    made there (or the dtype's view of its bytes, which nothing else holds) and no view of it
    is alive."""
    if sys.version_info >= (3, 14) or weakref.getweakrefcount(a):
        return False
    if not a.flags.owndata:
        # each base's references: the one that has it as base, this name and getrefcount's
        # argument
        base = a.base
        if isinstance(base, np.ndarray) and isinstance(base.base, _Lease):
            if sys.getrefcount(base) != 3:
                return False
            base = base.base
        if not (isinstance(base, _Lease) and sys.getrefcount(base) == 3):
            return False
        del base
    # getrefcount counts its own argument and this function's parameter
    return sys.getrefcount(a) - 2 == holders
