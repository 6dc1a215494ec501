"""Large arrays with their pages faulted in by one ``madvise``.

On a VM, touching a fresh 154 MB mapping page by page costs 0.3-0.4 s of page faults (a
GPT-2-size E); asking the kernel to populate it costs ~0.05 s.  A check at production size
makes a few such arrays (E, the reference's logits, E after the SGD step, the shared blocks
to and from the worker): each is made here.  Where the advice is unknown (not Linux, a kernel
before 5.14) the pages fault in on first use, as they would anyway.

Such a mapping is unmapped when its last array goes, not kept for the next array of its
size: kept, a warm case at GPT-2 size took 0.12-0.19 s less, but whatever this process ran
next paid for it (one forward+backward of torch right after a warm case took 0.6-0.7 s
longer in 1 run of 6 and 1 of 12, all of it system time on the same page faults; see
docs/speed.md).
"""

from __future__ import annotations

import math
import mmap
import sys
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
    holds a private anonymous mapping, unmapped when the array and every view of it have
    gone."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < POPULATE_ABOVE or not sys.platform.startswith("linux"):
        return np.empty(shape, dtype=dt)
    # Private, not mmap's default shared mapping: shared anonymous memory is shmem, whose
    # pages cost more to populate (a warm case's three such arrays at GPT-2 size: 0.31-0.39 s
    # shared, 0.17-0.20 s private).  Not huge pages (as numpy asks for its own): beside a
    # worker whose allocations fragment memory, populating them stalled on compaction for
    # 0.2-0.4 s an array.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    populate(mapping, write=True)
    return leased(mapping, shape, dt, _unmapped)


def _unmapped(mapping: mmap.mmap) -> None:
    """An array of :func:`empty` has gone: its mapping goes with it (see the module's
    docstring)."""


def leased(mapping: mmap.mmap, shape: tuple[int, ...], dtype: Any,
           give_back: Callable[[mmap.mmap], None]) -> np.ndarray:
    """The array of ``shape`` and ``dtype`` at the start of ``mapping`` (its pages already
    in), which holds the mapping until the array and every view of it have gone; then
    ``give_back(mapping)`` (a worker's result blocks in ``engine.isolation`` are offered for
    its next results); a mapping it keeps no reference to is unmapped."""
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
