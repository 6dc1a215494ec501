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
    # bytes first, then the dtype: a dtype numpy names by no type string of its own
    # (bfloat16's is '<V2') survives a view, not an __array_interface__
    out: np.ndarray = np.asarray(_Lease(mapping, nbytes)).view(dt).reshape(shape)
    return out


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


def drop_pool() -> None:
    """Unmap every kept mapping (see ``POOL_BYTES``)."""
    with _POOL_LOCK:
        _FREE.clear()


class _Lease:
    """The base of an array of :func:`empty` and of every view of it: it holds the mapping
    (and the buffer export that gives its address), and gives it back to the pool when the
    last of them goes, which no weak reference to an array could tell (a view outlives the
    array it was taken from)."""

    def __init__(self, mapping: mmap.mmap, nbytes: int) -> None:
        self._mapping = mapping
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)  # the export: mapped while held
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (self._bytes.ctypes.data, False)}

    def __del__(self) -> None:
        try:
            mapping, size = self._mapping, len(self._mapping)
            with _POOL_LOCK:
                if size + sum(len(m) for m in _FREE) <= POOL_BYTES:
                    _FREE.append(mapping)
        except Exception:  # noqa: BLE001  (interpreter shutdown: the mapping just goes)
            pass


def over(mapping: mmap.mmap, shape: tuple[int, ...], dtype: Any, *, write: bool
         ) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` at the start of ``mapping``, which it keeps alive;
    its pages faulted in at once (for writing, or for reading what is there)."""
    populate(mapping, write=write)
    _MADE.add(mapping)
    # the mapping itself as the array's base (not a view of a view of it): see unshared
    return np.ndarray(shape, dtype=np.dtype(dtype), buffer=mapping)


#: The mappings :func:`over` put an array on: this process's own (an anonymous mapping, or a
#: worker's result block, its name unlinked when taken), never a file of the user's.
_MADE: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()


def unshared(a: np.ndarray, holders: int) -> bool:
    """Whether nothing but the ``holders`` references the caller counts can reach ``a``'s
    memory: it owns its buffer (not a view of one an adapter may keep), no weak reference to it
    exists, and its reference count is exactly ``holders``.  Such an array cannot be written
    by whoever made it, so it can be kept as it is where a copy was made "in case the adapter
    reuses its buffer" (a [V, d] copy is 2.1 GB at Llama-3's head).  Anything uncertain says
    False (a copy stays the safe answer): an array that is a view, a memory-mapped one, and
    interpreters whose counts can be lower than the references (3.14 borrows references on
    the stack).  An array on a mapping of :func:`over`'s owns it as much, when it is the whole
    of the mapping's array and nothing else holds the mapping."""
    if sys.version_info >= (3, 14) or weakref.getweakrefcount(a):
        return False
    if not a.flags.owndata:
        base = a.base
        # the mapping's references: the array's base, this name and getrefcount's argument
        # (a WeakSet holds none)
        if not (isinstance(base, mmap.mmap) and base in _MADE and sys.getrefcount(base) == 3):
            return False
        del base
    # getrefcount counts its own argument and this function's parameter
    return sys.getrefcount(a) - 2 == holders
