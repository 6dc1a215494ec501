"""Shared blocks: large arrays cross between the processes through shared memory.

Arrays of :data:`SHARE_ABOVE` bytes or more cross through named shared-memory blocks, one copy
each way, instead of being pickled (several).  The parent writes each large input into a block
of its own (reused from call to call), the worker hands the adapter views of those blocks
uncopied, and the parent compares each block with what it wrote after the call
(:func:`_written_over`).  A large dE comes back in a block that the parent takes over as it is
(:func:`_take`).  :data:`_BLOCKS` names every block this process made, for the cleanup at exit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from tyingspec._src.engine.isolation.wire import _dtype_of, _dtype_token, _Refused, _Shared

#: Arrays at least this large cross the pipe through shared memory (one copy each way) instead
#: of being pickled (several): at V = 50257 that is most of the isolation's cost.
SHARE_ABOVE = 1 << 20

#: Bytes of result blocks whose dE has gone kept, in all, for later results (see
#: ``handle.Worker._message``): a warm case at GPT-2 size returns two 154 MB dE, and each came
#: back 0.04 s sooner written over a block taken before (``bench_warm_timeline``: from the
#: call's return to its answer read here, 0.062 s against 0.103 s; the whole case, 2 runs of
#: 10 and 12 interleaved pairs in one process, -0.01 s and -0.05 s, 6 of 10 and 6 of 12
#: faster, within the call's own spread).  A block larger than half of it is never kept (the
#: worker closes it once sent, as before): at Llama-3's head a dE is 2.1 GB, and holding one
#: past its dE would add to the check's peak.  Unlike this process's own arrays kept for reuse
#: (see ``core.memory``), these cost what runs next nothing measurable: one forward+backward
#: of torch after a warm case, 12 runs each, 1.85-1.96 s with them kept, 1.87-2.00 s with
#: none.  The cold command's two dE are both alive when the second comes back: it takes none
#: again.
RESULTS_KEPT = 1 << 30


def _large(a: Any) -> bool:
    import numpy as np

    return isinstance(a, np.ndarray) and a.nbytes >= SHARE_ABOVE and not a.dtype.hasobject


def _same_arrays(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether ``b`` holds the very objects ``a`` does under the same names (the inputs a
    block was written from are still the call's: identity, not equality, which would read
    them all)."""
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


#: The shared blocks this process made for its workers' calls (inputs) or named for their
#: results, until unlinked or taken: what :func:`_end_all` unlinks.
_BLOCKS: set[str] = set()


def _create(nbytes: int, name: str | None = None, *, populate: bool = True) -> Any:
    """A new shared block of ``nbytes``, its pages faulted in for writing (``populate``), or
    none allocated yet (a block :func:`_write_result` fills through its descriptor)."""
    from multiprocessing import shared_memory

    from tyingspec._src.core import memory

    block = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    if populate:
        memory.populate(block, write=True)
    return block


def _take(shared: _Shared, give_back: Callable[[Any], None]) -> Any:
    """The array the worker left in the block ``shared.name``, made this process's own without
    a copy: the array holds a mapping of the block, whose name is unlinked at once, so its
    memory goes with the array (or to ``give_back``, see ``core.memory.leased``).  (Copying it
    out instead writes a fresh [V, d] array: 0.1-0.6 s of page faults at GPT-2 size on a VM,
    where mapping the populated block takes ~0.01 s.)  _Refused when the block is missing or
    smaller than the array said to be in it."""
    import mmap
    from multiprocessing import shared_memory

    from tyingspec._src.core import memory

    dtype = _dtype_of(shared.dtype)
    try:
        block = shared_memory.SharedMemory(name=shared.name)
    except (FileNotFoundError, OSError) as exc:
        raise _Refused(f"a result block {shared.name!r} that cannot be opened "
                       f"({type(exc).__name__})") from None
    _BLOCKS.discard(shared.name)
    try:
        nbytes = math.prod(shared.shape) * dtype.itemsize
        if block.size < nbytes:
            raise _Refused(f"a result block of {block.size} bytes for an array of {nbytes}")
        # a mapping of the array's own: the block's goes when the block is closed, even
        # under an array viewing it, so its descriptor is mapped again
        mapping = mmap.mmap(block._fd, block.size)  # type: ignore[attr-defined]
    finally:
        block.close()
        block.unlink()
    memory.populate(mapping, write=False)
    return memory.leased(mapping, shared.shape, dtype, give_back)


def _taken_again(shared: _Shared, mapping: Any, give_back: Callable[[Any], None]) -> Any:
    """The array the worker left in a block taken before (``mapping``, this process's, its
    pages in): see :func:`_take`."""
    from tyingspec._src.core import memory

    try:
        return memory.leased(mapping, shared.shape, _dtype_of(shared.dtype), give_back)
    except ValueError as exc:
        raise _Refused(f"a result block {shared.name!r} too small: {exc}") from None


def _in_block(a: Any, block: Any) -> Any:
    """The array of ``a``'s shape and dtype that ``block`` holds (or is to hold)."""
    import numpy as np

    return np.ndarray(a.shape, dtype=a.dtype, buffer=block.buf)


def _write(a: Any, block: Any) -> _Shared:
    import numpy as np

    np.copyto(_in_block(a, block), a, casting="no")
    return _Shared(block.name, tuple(a.shape), _dtype_token(a.dtype))


#: Bytes one ``os.pwrite`` is handed at a time (Linux writes at most 2 GiB - 4 KiB a call).
_PWRITE_BYTES = 1 << 30


def _write_result(a: Any, block: Any) -> _Shared:
    """``a`` written into a fresh block (made with ``populate=False``: a call's result in the
    worker, or a call's input in a block of a new size here) through the block's file
    descriptor: the kernel fills each new page with the bytes as it allocates it, where
    populating the mapping first zeroes every page and the copy then writes it again (a
    GPT-2-size dE in benchmarks/bench_warm_timeline.py: 0.053-0.067 s a call against
    0.077-0.099 s; a GPT-2-size E, 0.057 CPU seconds against 0.098).  An array not laid out
    in C order is populated and copied: its bytes in order would be a whole copy first."""
    import numpy as np

    from tyingspec._src.core import memory

    fd = getattr(block, "_fd", -1)
    if not hasattr(os, "pwrite") or fd < 0 or not a.flags.c_contiguous:
        memory.populate(block, write=True)
        return _write(a, block)
    raw = a.reshape(-1).view(np.uint8).data  # a memoryview
    done = 0
    while done < raw.nbytes:
        wrote = os.pwrite(fd, raw[done:done + _PWRITE_BYTES], done)
        if wrote <= 0:
            raise OSError(f"writing the shared block {block.name!r} stopped at byte {done} "
                          f"of {raw.nbytes}")
        done += wrote
    return _Shared(block.name, tuple(a.shape), _dtype_token(a.dtype))


def _attach(name: str, attached: dict[str, Any]) -> Any:
    """The block ``name``, mapped once and kept: the same blocks come back call after call, and
    a mapping already faulted in costs nothing the next time."""
    block = attached.get(name)
    if block is None:
        from multiprocessing import shared_memory

        from tyingspec._src.core import memory

        block = attached[name] = shared_memory.SharedMemory(name=name)
        memory.populate(block, write=False)
    return block


def _view(x: Any, attached: dict[str, Any]) -> Any:
    """The array behind a :class:`_Shared` (a view into its block), else ``x`` itself."""
    if not isinstance(x, _Shared):
        return x
    import numpy as np

    return np.ndarray(x.shape, dtype=_dtype_of(x.dtype), buffer=_attach(x.name, attached).buf)


def _release(blocks: Any, *, unlink: bool) -> None:
    """Close (and unlink) every block of ``blocks`` (a list, or a dict's values), then empty
    it.  A block whose buffer is exported (a memoryview of it) stays mapped until that goes;
    a numpy array over it exports nothing and would be left viewing unmapped memory, so no
    array may view a block released here."""
    for block in list(blocks.values() if isinstance(blocks, dict) else blocks):
        try:
            block.close()
        except BufferError:
            pass
        if unlink:
            _BLOCKS.discard(block.name)
            try:
                block.unlink()
            except (FileNotFoundError, OSError):
                pass
    blocks.clear()


def _written_over(inputs: Mapping[str, Any], written: Mapping[str, Any]) -> set[str]:
    """The inputs sent through shared memory (``written``: the block each went into) whose
    block no longer holds, bit for bit, what this process wrote there.  The worker hands those
    to the adapter uncopied (see :class:`~core.adapters.PrivateInputs`): its write into
    one shows here, and the caller's own array never saw it."""
    from tyingspec._src.core.adapters import same_bits

    return {k for k, block in written.items() if not same_bits(inputs[k],
                                                               _in_block(inputs[k], block))}


def _forget(attached: dict[str, Any], keep: set[str]) -> None:
    """Close the attached blocks the other process no longer sends (it has unlinked them)."""
    gone = {n: b for n, b in attached.items() if n not in keep}
    for name in gone:
        del attached[name]
    _release(gone, unlink=False)


def _unlink(name: str | None) -> None:
    """Unlink the block ``name`` if there is one: a call's result block that was not taken (the
    call failed, or the worker was killed before it could answer)."""
    from multiprocessing import shared_memory

    if name is None:
        return
    _BLOCKS.discard(name)
    try:
        block = shared_memory.SharedMemory(name=name)
    except (FileNotFoundError, OSError):
        return
    _release([block], unlink=True)
