"""User code runs in a worker process: its crash, exit or hang ends a case, never the run.

A ``module:attr`` target is imported and called in one persistent worker process: a fresh
interpreter that runs :mod:`engine.worker`, with this process's ``sys.path`` (set before it
imports anything), working directory and ``sys.argv``, so nothing of tyingspec's own state leaks
into it and user modules import as they do here.  Unlike a ``spawn`` child it never imports this
process's ``__main__``: a user's script that runs a check needs no ``if __name__ ==
"__main__":`` guard (a spawned worker re-ran the script).  The parent sends the inputs of a
call and waits, with a timeout, for the validated result.  When the worker raises
``SystemExit``, calls ``os._exit``, dies of a signal or runs past the timeout, that call becomes
an :class:`~tyingspec.AdapterError` naming what happened, the worker is killed and a fresh one
is started for the next call: the remaining cases run.  Built-in targets are tyingspec's own
code and run in-process.

State an adapter keeps between calls (a stateful bug, or a cache) lives in the worker and
survives from one call to the next, as it would in the user's training loop, until the worker
has to be restarted.

Large arrays cross through shared memory, one copy each way.  The parent writes each large
input into a block of its own (reused from call to call); the worker hands the adapter views
of those blocks uncopied, since they are the call's own, and after the call the parent compares
each block with what it wrote: a write into an input is still reported, and the caller's arrays
are never touched.  A large dE comes back in a block that the parent takes over as it is: a new
one, or one whose last dE has gone here and that the parent offered for this call (a warm
check's calls return the same [V, d] dE call after call, and a block taken again has its pages
in, on both sides).

The parent never executes what the worker sends.  User code runs in the worker and can forge
anything the worker says (it can write to the pipe itself), and unpickling runs whatever the
bytes name, so nothing from the worker is unpickled: each answer is one frame of plain data (a
JSON tree of numbers, strings, containers and tyingspec's own result types, then the raw bytes
of its arrays, in a numeric dtype of a fixed list).  Decoding it calls no function the frame
names; a frame that is not of that form (a pickle, an object array, a dataclass with a field of
its own) is an AdapterError that says what was refused, and the worker is killed.  What the
parent sends the worker is still pickled: the worker trusts its parent.

No process of a run outlives it.  The worker leads a process group of its own, which whatever
its target forks joins, and on Linux is a child subreaper, so that a process its target forked
stays below it even after leaving that group (a ``setsid()``, a daemon's double fork): the
parent ends a worker by killing every process below it and its group, and a worker that ends
(even one whose parent was killed) does the same last.  The parent ends its workers at exit
(a KeyboardInterrupt included) and on SIGTERM or SIGHUP (see :func:`install_signal_cleanup`),
and unlinks every shared block it made for them.

Each answer also names the files the worker's code came from, read since the last answer, with
a digest of each (:class:`_Sources`): what a kept worker is keyed on (see :mod:`engine.warm`).
"""

from __future__ import annotations

import atexit
import copy
import faulthandler
import hashlib
import json
import math
import multiprocessing
import os
import re
import secrets
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from tyingspec._src.core.options import DEFAULT_TIMEOUT

# numpy (and core.memory, which needs it) load where they are used: the command starts its
# worker before this process loads numpy (see :func:`launch_early`).

__all__ = ["DEFAULT_TIMEOUT", "Worker", "install_signal_cleanup", "launch_early"]
#: Seconds the import and signature check of a target may take.
LOAD_TIMEOUT = 120.0


#: Bytes of result blocks whose dE has gone kept, in all, for later results (see
#: :meth:`Worker._message`): a warm case at GPT-2 size returns two 154 MB dE, and each came
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

#: Arrays at least this large cross the pipe through shared memory (one copy each way) instead
#: of being pickled (several): at V = 50257 that is most of the isolation's cost.
SHARE_ABOVE = 1 << 20


@dataclass(frozen=True)
class _Shared:
    """An array left in a named shared-memory block for the other process."""

    name: str
    shape: tuple[int, ...]
    dtype: str


# ---- the worker's answers: plain data, never a pickle ----------------------------------------

#: The first bytes of every frame the worker sends (a pickle starts with b"\x80"), then the
#: length of its JSON tree (an unsigned 64-bit little-endian integer), the tree, and the raw
#: bytes of its arrays, which the tree's array nodes locate by offset.
_MAGIC = b"tyingspec-worker-answer/1\n"
_HEAD = struct.Struct("<Q")
#: A legitimate answer nests a few levels deep; a deeper one is refused before it costs much.
_MAX_DEPTH = 32
#: The dtypes an array may cross in: numeric, byte order explicit (``np.dtype(...).str``), or
#: ml_dtypes' bfloat16 by name (its ``.str`` is the void ``<V2``).  No object, string, void or
#: structured dtype: an object dtype carries pickled objects, a structured one may hold them.
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
#: The fields of an AdapterError, all text or None: it crosses as these, not as itself.
_ERROR_FIELDS = ("adapter", "problem", "key", "expected", "got")


class _Unsendable(TypeError):
    """A value the channel does not carry, found by the worker as it encodes an answer."""


class _Refused(ValueError):
    """A frame from the worker that the parent does not take; the message says what it is."""


def _type_name(x: Any) -> str:
    kind = type(x)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"


def _dtype_token(dt: Any) -> str:
    """The name ``dt`` crosses the channel (and a shared block's description) under."""
    if dt.kind == "V" and dt.name == "bfloat16" and dt.fields is None:
        return "bfloat16"
    token = str(dt.str)
    if not _DTYPE.fullmatch(token) or dt.fields is not None or dt.subdtype is not None:
        raise _Unsendable(f"an array of dtype {dt}")
    return token


def _dtype_of(token: Any) -> Any:
    """The dtype named by ``token`` (see :func:`_dtype_token`); _Refused for any other."""
    import numpy as np

    if token == "bfloat16":
        from tyingspec._src.core.tolerance import numpy_dtype

        return numpy_dtype("bfloat16")
    if not isinstance(token, str) or not _DTYPE.fullmatch(token):
        raise _Refused(f"an array of dtype {token!r}"[:200])
    return np.dtype(token)


def _encode(answer: Any) -> bytes:
    """The frame that carries ``answer`` to the parent; _Unsendable names a value it cannot
    carry (anything but plain data, numeric arrays and tyingspec's own result types)."""
    import numpy as np

    from tyingspec._src.core.adapters import AdapterError, Returned
    from tyingspec._src.core.findings import Finding

    chunks: list[Any] = []
    size = 0

    def data(a: np.ndarray[Any, Any]) -> dict[str, Any]:
        nonlocal size
        token = _dtype_token(a.dtype)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # no copy when contiguous
        chunks.append(raw)
        size += raw.nbytes
        return {"dtype": token, "shape": list(a.shape), "at": size - raw.nbytes}

    def enc(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unsendable("a value nested too deeply")
        if x is None or x is True or x is False:
            return x
        if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_)):
            return {"$": "scalar", **data(np.asarray(x))}
        if isinstance(x, str):
            return str(x)
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x)
        if isinstance(x, np.ndarray):
            return {"$": "array", **data(x)}
        if isinstance(x, list):
            return [enc(v, depth + 1) for v in x]
        if isinstance(x, (tuple, set, frozenset)):
            tag = "tuple" if isinstance(x, tuple) else \
                "frozenset" if isinstance(x, frozenset) else "set"
            return {"$": tag, "items": [enc(v, depth + 1) for v in x]}
        if isinstance(x, Mapping):
            return {"$": "dict", "items": [[enc(k, depth + 1), enc(v, depth + 1)]
                                           for k, v in x.items()]}
        if type(x) in (Returned, Finding, _Shared):
            return {"$": type(x).__name__,
                    "fields": {f.name: enc(getattr(x, f.name), depth + 1) for f in fields(x)}}
        if isinstance(x, AdapterError):  # a subclass too: it crosses as its fields
            text = {n: getattr(x, n, None) for n in _ERROR_FIELDS}
            bad = next((n for n, v in text.items() if v is not None and not isinstance(v, str)),
                       None)
            if bad is not None:
                raise _Unsendable(f"an AdapterError whose {bad} is an object of type "
                                  f"{_type_name(text[bad])}")
            return {"$": "AdapterError", "fields": {n: None if v is None else str(v)
                                                    for n, v in text.items()}}
        raise _Unsendable(f"an object of type {_type_name(x)}")

    head = json.dumps(enc(answer, 0), separators=(",", ":")).encode()
    return b"".join([_MAGIC, _HEAD.pack(len(head)), head, *chunks])


def _decode(frame: bytes) -> Any:
    """The answer a frame from the worker carries, built from plain data alone: no function
    the frame names is called, nothing is unpickled.  _Refused says what was refused."""
    if not frame.startswith(_MAGIC):
        raise _Refused("a pickle (the parent never unpickles what the worker sends)"
                       if frame[:1] == b"\x80" else
                       f"{len(frame)} bytes that are not a tyingspec message, starting "
                       f"{bytes(frame[:16])!r}")
    start = len(_MAGIC) + _HEAD.size
    if len(frame) < start:
        raise _Refused("a truncated message")
    (n,) = _HEAD.unpack_from(frame, len(_MAGIC))
    if n > len(frame) - start:
        raise _Refused(f"a message whose header claims {n} bytes, of {len(frame) - start}")
    try:
        tree = json.loads(frame[start:start + n])
        return _Decoder(memoryview(frame)[start + n:]).value(tree, 0)
    except _Refused:
        raise
    except RecursionError:
        raise _Refused("a message nested too deeply") from None
    except Exception as exc:  # noqa: BLE001  (malformed in any way: refused, not a traceback)
        raise _Refused(f"a malformed message ({type(exc).__name__}: {exc})"[:300]) from None


class _Decoder:
    """Plain values from a frame's JSON tree and the array bytes that follow it."""

    def __init__(self, body: memoryview) -> None:
        self.body = body

    def value(self, node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Refused("a message nested too deeply")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.value(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise _Refused(f"a value of type {type(node).__name__}")
        tag = node.get("$")
        if tag in ("array", "scalar"):
            _keys(node, "$", "dtype", "shape", "at")
            a = self.array(node)
            if tag == "scalar":
                if a.shape != ():
                    raise _Refused(f"a scalar of shape {a.shape}")
                return a[()]
            return a
        if tag in ("tuple", "set", "frozenset", "dict"):
            _keys(node, "$", "items")
            items = node["items"]
            if not isinstance(items, list):
                raise _Refused(f"a {tag} whose items are not a list")
            if tag == "dict":
                if not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
                    raise _Refused("a dict whose items are not pairs")
                return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in items}
            values = [self.value(v, depth + 1) for v in items]
            return tuple(values) if tag == "tuple" else set(values) if tag == "set" \
                else frozenset(values)
        if tag in ("Returned", "Finding", "_Shared", "AdapterError"):
            _keys(node, "$", "fields")
            given = node["fields"]
            if not isinstance(given, dict):
                raise _Refused(f"a {tag} whose fields are not a mapping")
            return _build(tag, {str(k): self.value(v, depth + 1) for k, v in given.items()})
        raise _Refused(f"an object tagged {tag!r}"[:200])

    def array(self, node: dict[str, Any]) -> Any:
        import numpy as np

        dt = _dtype_of(node["dtype"])
        shape, at = node["shape"], node["at"]
        if not (isinstance(shape, list) and len(shape) <= 32 and
                all(type(s) is int and s >= 0 for s in shape)):
            raise _Refused(f"an array of shape {shape!r}"[:200])
        if type(at) is not int or at < 0:
            raise _Refused(f"an array at offset {at!r}"[:200])
        nbytes = math.prod(shape) * dt.itemsize
        if at + nbytes > len(self.body):
            raise _Refused(f"an array of {nbytes} bytes where the message has "
                           f"{max(len(self.body) - at, 0)}")
        if nbytes == 0:
            return np.zeros(shape, dtype=dt)
        # a copy: the array is this process's own, writable and aligned (as unpickled)
        return np.frombuffer(self.body[at:at + nbytes], dtype=dt).reshape(shape).copy()


def _keys(node: dict[str, Any], *keys: str) -> None:
    if set(node) != set(keys):
        raise _Refused(f"a {node.get('$')!r} node with keys {sorted(map(str, node))}"[:200])


def _build(tag: str, given: dict[str, Any]) -> Any:
    """One of tyingspec's own result types from its fields, each checked for its type (a
    field of the object's own, say one shadowing a method, is refused)."""
    import numpy as np

    from tyingspec._src.core.adapters import AdapterError, Returned, _adapter_error
    from tyingspec._src.core.findings import Finding
    from tyingspec._src.core.tolerance import PRECISIONS

    def text(x: Any) -> bool:
        return isinstance(x, str)

    def maybe_text(x: Any) -> bool:
        return x is None or isinstance(x, str)

    def maybe_array(x: Any) -> bool:
        return x is None or isinstance(x, np.ndarray)

    checks: dict[str, dict[str, Callable[[Any], bool]]] = {
        "_Shared": {"name": text, "dtype": lambda x: _dtype_of(x) is not None,
                    "shape": lambda x: isinstance(x, tuple) and all(
                        type(s) is int and s >= 0 for s in x)},
        "Finding": {"check": text, "invariant": text, "detail": text, "label": maybe_text,
                    "outcome": lambda x: x in ("passed", "failed", "not_applicable"),
                    "evaluations": lambda x: type(x) is int, "power": lambda x: type(x) is bool},
        "Returned": {"dE": lambda x: isinstance(x, (np.ndarray, _Shared)),
                     "mutated": lambda x: isinstance(x, tuple) and all(map(text, x)),
                     "precision": lambda x: x in PRECISIONS,
                     "loss": lambda x: x is None or type(x) is float,
                     "dW": maybe_array, "db": maybe_array,
                     "evidence": lambda x: isinstance(x, dict),
                     "findings": lambda x: isinstance(x, tuple) and all(
                         type(f) is Finding for f in x)},
        "AdapterError": {"adapter": text, "problem": text, "key": maybe_text,
                         "expected": maybe_text, "got": maybe_text},
    }
    kind: type[Any] = {"_Shared": _Shared, "Finding": Finding, "Returned": Returned,
                       "AdapterError": AdapterError}[tag]
    names = set(_ERROR_FIELDS) if kind is AdapterError else {f.name for f in fields(kind)}
    if set(given) != names:
        raise _Refused(f"a {tag} with fields {sorted(given)}"[:300])
    # a field added since this table was written crosses as plain data, unchecked
    check = {k: ok for k, ok in checks[tag].items() if k in names}
    bad = next((k for k, ok in check.items() if not ok(given[k])), None)
    if bad is not None:
        raise _Refused(f"a {tag} whose {bad} is {_type_name(given[bad])} "
                       f"{repr(given[bad])[:80]}")
    if tag == "AdapterError":
        error: AdapterError = _adapter_error(*(given[k] for k in _ERROR_FIELDS))
        return error
    return kind(**given)


def _loaded_answer(answer: Any) -> Any:
    """``answer`` when it is one the worker gives after loading its target."""
    from tyingspec._src.core.adapters import AdapterError

    if isinstance(answer, tuple) and len(answer) == 4 and answer[0] == "loaded" and \
            (answer[1] is None or isinstance(answer[1], str)) and \
            isinstance(answer[2], list) and all(isinstance(k, str) for k in answer[2]) and \
            _file_digests(answer[3]):
        return answer
    if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "error" and \
            isinstance(answer[1], AdapterError):
        return answer
    raise _Refused(f"an answer to the load of another form: {repr(answer)[:120]}")


def _call_answer(answer: Any) -> Any:
    """``answer`` when it is one the worker gives to a call."""
    from tyingspec._src.core.adapters import AdapterError, Returned

    if isinstance(answer, tuple) and len(answer) == 4 and \
            isinstance(answer[2], set) and all(isinstance(k, str) for k in answer[2]) and \
            _file_digests(answer[3]) and \
            ((answer[0] == "ok" and isinstance(answer[1], Returned)) or
             (answer[0] == "error" and isinstance(answer[1], AdapterError))):
        return answer
    raise _Refused(f"an answer to a call of another form: {repr(answer)[:120]}")


def _file_digests(x: Any) -> bool:
    """Whether ``x`` is what the worker says its code read: paths and their digests."""
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str)
                                       for k, v in x.items())


def _large(a: Any) -> bool:
    import numpy as np

    return isinstance(a, np.ndarray) and a.nbytes >= SHARE_ABOVE and not a.dtype.hasobject


def _same_arrays(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether ``b`` holds the very objects ``a`` does under the same names (the inputs a
    block was written from are still the call's: identity, not equality, which would read
    them all)."""
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


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


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


# ---- the files a worker's code came from ---------------------------------------------------

#: A file of at least this many bytes (a checkpoint, a data set read as the target loads) is
#: keyed on what the file system says of it instead of on its bytes: hashing it at every check
#: would cost what reading it does.
HASH_BELOW = 1 << 24


def digest(path: str) -> str | None:
    """What the file ``path`` holds now: a hash of its bytes; for a file of ``HASH_BELOW``
    bytes or more its device, inode, size, modification and change times (the change time is
    set by the kernel at every write, and by no ``os.utime``, ``cp -p`` or ``rsync -t``);
    ``"missing"`` when there is none; None when it is not a regular file (a directory, a pipe,
    a device: nothing whose content the code came from)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        return f"unreadable:{exc.errno}"
    if not stat.S_ISREG(st.st_mode):
        return None
    if st.st_size >= HASH_BELOW:
        return f"stat:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    try:
        with open(path, "rb") as f:
            data = f.read(HASH_BELOW)
    except OSError as exc:
        return f"unreadable:{exc.errno}"
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def unchanged(sources: Mapping[str, str]) -> bool:
    """Whether every file of ``sources`` (path: :func:`digest` as it was read) holds what it
    held.  Reads the files' bytes, and imports and runs nothing of them."""
    return all(digest(path) == was for path, was in sources.items())


def _installed_dirs() -> tuple[str, ...]:
    """Where code lives that is not the user's: the standard library (and the folder that
    holds it) and site-packages of each prefix this interpreter has, tyingspec's own package,
    and the kernel's file systems (each as given and as its real path, with a trailing
    separator: a prefix of what is inside)."""
    import site
    import sysconfig

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dirs = {here, "/dev", "/proc", "/sys"}
    for base in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        where = sysconfig.get_paths(vars={"base": base, "platbase": base, "installed_base": base,
                                          "installed_platbase": base})
        dirs.update(where[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
        # beside the standard library: its zip (python311.zip), which imports look for
        dirs.update(os.path.dirname(where[k]) for k in ("stdlib", "platstdlib"))
    dirs.update(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return tuple(sorted({os.path.join(f(d), "") for d in dirs
                         for f in (os.path.abspath, os.path.realpath)}))


#: Folders whose files are no source of the worker's code wherever they are.
_NOT_SOURCES = ("__pycache__", ".dist-info", ".egg-info")


class _Sources:
    """The worker's record of what its code came from outside the installed environment: each
    module it imported from there and each file it opened there to read (a sibling module, a
    config file read at import, one read at a call), with the file's :func:`digest` as it was
    read.  The parent keeps the worker for the next ``tyingspec.check`` only while every one of
    them still holds that (see :mod:`engine.warm`).  An audit hook sees each ``open`` (added
    before the target is imported; a hook cannot be removed, so it stays for the worker's
    life); a module whose cached bytecode was current was imported without opening its
    source, so the modules are read too, whenever there are more of them."""

    def __init__(self) -> None:
        self.skip = _installed_dirs()
        self.seen: set[str] = set()
        self.found: dict[str, str] = {}  # read since the last answer
        self.modules = 0
        self.lock = threading.Lock()  # a thread of the target's may open a file as take() runs

    def opened(self, event: str, args: tuple[Any, ...]) -> None:
        """The audit hook: note a file opened to read (not one opened to write: what the code
        writes is not what it came from)."""
        if event != "open" or isinstance(args[0], int):  # an open file descriptor
            return
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else 0
        if isinstance(mode, str):  # open(), io.open_code, FileIO
            if any(c in mode for c in "wax+"):
                return
        elif not isinstance(flags, int) or flags & (os.O_WRONLY | os.O_RDWR):  # os.open
            return
        try:
            path = os.fsdecode(os.fspath(args[0]))
        except TypeError:
            return
        # a module's cached bytecode is its source's (noted as a module), and an installed
        # distribution's metadata (read by importlib.metadata) is the environment's
        if not os.path.basename(os.path.dirname(path)).endswith(_NOT_SOURCES):
            self.note(os.path.abspath(path))

    def note(self, path: str) -> None:
        if path in self.seen or path.startswith(self.skip):
            return
        self.seen.add(path)  # first: digest's own open comes back here
        found = digest(path)
        if found is not None:
            with self.lock:
                self.found[path] = found

    def take(self) -> dict[str, str]:
        """What was read since the last answer, the source of every module imported since
        included; forgotten here once taken (the parent keeps it)."""
        if len(sys.modules) != self.modules:
            self.modules = len(sys.modules)
            for module in list(sys.modules.values()):
                try:  # past a lazy module's own __getattribute__, which would import it
                    where = object.__getattribute__(module, "__dict__").get("__file__")
                except Exception:  # noqa: BLE001  (anything may sit in sys.modules)
                    continue
                if isinstance(where, str):
                    self.note(os.path.abspath(where))
        with self.lock:
            found, self.found = self.found, {}
        return found


def _serve(conn: Connection, spec: str, kind: str, paths: tuple[str, ...]) -> None:
    """The worker's loop: import the target once, then answer calls until told to stop; then
    end whatever the target forked (see :func:`_end_group`)."""
    faulthandler.enable()
    _own_group()
    try:
        _load_and_answer(conn, spec, kind, paths)
    finally:
        _end_group()


def _load_and_answer(conn: Connection, spec: str, kind: str, paths: tuple[str, ...]) -> None:
    """Import the target and say how that went, then answer calls until told to stop."""
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    from tyingspec._src.core.adapters import AdapterError
    from tyingspec._src.kinds.table import KINDS, fitting, resolve

    table = KINDS[kind]
    sources = _Sources()
    sys.addaudithook(sources.opened)  # before the target's import: it sees what that reads
    try:
        if table.before_import is not None:
            table.before_import()
        fn = resolve(spec, kind)
        problem, fits = fitting(fn, kind)
        _send(conn, spec, ("loaded", problem, fits, sources.take()))
    except AdapterError as exc:
        _send(conn, spec, ("error", exc))
        return
    except BaseException as exc:  # noqa: BLE001  (SystemExit at import included)
        _send(conn, spec, ("error", AdapterError(spec, "import raised", got=_exc_text(exc))))
        return
    attached: dict[str, Any] = {}  # the parent's blocks, mapped once
    try:
        _answer(conn, spec, fn, table, attached, sources)
    finally:
        _release(attached, unlink=False)


def _send(conn: Connection, spec: str, answer: tuple[Any, ...], *,
          tail: tuple[Any, ...] | None = None) -> None:
    """Send ``answer`` as a frame (see :func:`_encode`), the answer to a call when ``tail``
    (what follows its result: the blocks whose views the adapter kept, the files read since
    the last answer) is given.  One the channel cannot carry goes as the AdapterError that says
    what it held: the worker never falls back to a pickle."""
    from tyingspec._src.core.adapters import AdapterError

    try:
        frame = _encode(answer)
    except _Unsendable as exc:
        error = AdapterError(spec, "gave the worker something it cannot send to tyingspec",
                             expected="plain data (numbers, strings, containers, numeric "
                                      "arrays)", got=str(exc))
        frame = _encode(("error", error) if tail is None else ("error", error, *tail))
    conn.send_bytes(frame)


def _answer(conn: Connection, spec: str, fn: Any, table: Any, attached: dict[str, Any],
            sources: _Sources) -> None:
    """Answer calls until told to stop, each answer with the files the worker's code read
    since the last (see :class:`_Sources`).  A large dE goes back in a new block, under the
    name the parent chose for the call: the parent takes the block over, and can unlink that
    name whatever becomes of this process."""
    # blocks the adapter kept a view of, each with a weak reference to that view: mapped while
    # it is alive (closing a block unmaps it under any array still viewing it)
    held: list[tuple[Any, Any]] = []
    # the result blocks this process made, by name, until the parent lets them go: one whose
    # dE has gone there is offered for a later call's result (see Worker._message)
    results: dict[str, Any] = {}
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message is None:
                return
            gone = [b for b, view in held if view() is None]
            held[:] = [(b, view) for b, view in held if view() is not None]
            _release(gone, unlink=False)
            result, sent, offered, dropped, keep_to = message
            _release([results.pop(n) for n in dropped if n in results], unlink=False)
            answer, block = _call(spec, fn, table, (result, sent),
                                  {n: results[n] for n in offered if n in results},
                                  attached, held)
            reply = (*answer, sources.take())
            new = block is not None and block.name not in results
            try:
                _send(conn, spec, reply, tail=reply[2:])
            except BaseException:
                if new:  # never the parent's: its name is unlinked there, unread
                    block.close()
                raise
            if new and block.size <= keep_to:
                results[block.name] = block
            elif new:  # too large to be offered again: its memory goes with the parent's dE
                block.close()
    finally:
        _release([b for b, _ in held], unlink=False)
        _release(results, unlink=False)


def _call(spec: str, fn: Any, table: Any, message: tuple[str, dict[str, Any]],
          offered: dict[str, Any], attached: dict[str, Any], held: list[tuple[Any, Any]]
          ) -> tuple[tuple[str, Any, set[str]], Any]:
    """One call on what the parent sent (the result block's name, the inputs): the reply
    (``"ok"`` and the result, or ``"error"`` and the AdapterError; and the names of the blocks
    whose views the adapter kept) and the block dE went into, if any: one of the ``offered``
    blocks of its size (written over in place: its pages are in), else a new one."""
    from tyingspec._src.core.adapters import AdapterError, PrivateInputs

    result, sent = message
    shared = {k for k, v in sent.items() if isinstance(v, _Shared)}
    _forget(attached, {sent[k].name for k in shared})
    # the views are this call's own (the parent wrote the blocks for it and checks them after
    # it): the adapter gets them uncopied
    inputs: dict[str, Any] = PrivateInputs(
        {k: _view(v, attached) for k, v in sent.items()}, shared)
    # every array derived from a view (a slice, a torch tensor) keeps the view itself alive
    views = {sent[k].name: weakref.ref(inputs[k]) for k in shared}
    block = None
    payload: Any
    try:
        returned = table.invoke(spec, fn, inputs)
        inputs = {}
        if _large(returned.dE):
            nbytes = returned.dE.nbytes
            block = next((b for b in offered.values() if b.size == nbytes), None) or \
                _create(nbytes, result, populate=False)
            returned = replace(returned, dE=_write_result(returned.dE, block))
        status, payload = "ok", returned
    except AdapterError as exc:
        # a copy without the traceback, whose frames hold the views
        status, payload = "error", copy.copy(exc)
    except BaseException as exc:  # noqa: BLE001  (SystemExit, KeyboardInterrupt, ...)
        status, payload = "error", AdapterError(spec, "raised an exception",
                                                got=_exc_text(exc))
    inputs = {}
    # A view still alive is the adapter's (a cache, a head kept from the first call), held as
    # its own copy, as in-process: its block is never written again, and stays mapped here.
    kept = {name for name, view in views.items() if view() is not None}
    held += [(attached.pop(name), views[name]) for name in kept]
    return (status, payload, kept), block


# ---- no process of a run outlives it -------------------------------------------------------

#: Every worker process this process started and has not reaped yet, by pid (which is also its
#: process group's id): what :func:`_end_all` kills.
_LIVE: dict[int, _Process] = {}
#: The shared blocks this process made for its workers' calls (inputs) or named for their
#: results, until unlinked or taken: what :func:`_end_all` unlinks.
_BLOCKS: set[str] = set()
#: Signals whose default action ends this process without its exit handlers (a terminal's
#: hang-up, a ``kill``, and SIGINT if it was reset to the default).
_ENDING = ("SIGTERM", "SIGHUP", "SIGINT")
_installed = {"atexit": False, "signals": False}


def _own_group() -> None:
    """Make this worker the leader of a process group of its own, which whatever its target
    forks joins: one ``killpg`` ends them all.  Out of the terminal's foreground group, the
    worker no longer gets a Ctrl-C or a hang-up: the parent decides when it ends.  A SIGTERM
    (``Process.terminate``) ends the whole group too.  A child that leaves the group (a
    ``setsid()``, ``start_new_session=True``, a daemon's double fork) stays below the worker,
    a subreaper (see :func:`_adopt_orphans`), where :func:`_end_below` finds it."""
    _adopt_orphans()
    if not hasattr(os, "setpgrp"):
        return
    try:
        os.setpgrp()
    except OSError:
        return
    signal.signal(signal.SIGTERM, _end_group_on_signal)


def _adopt_orphans() -> None:
    """On Linux, make this worker a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process its
    target forked whose parent has gone is then the worker's child, not init's, so it stays in
    the worker's tree, however it left the worker's group."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _processes() -> list[tuple[int, int, int]] | None:
    """(pid, parent's pid, process group) of every process that runs (a zombie has ended),
    read from ``/proc``; None where there is none (then a worker's group alone is ended)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    table = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # the command's name, in parentheses, may hold spaces and parentheses itself
                state, ppid, group = f.read().rpartition(b")")[2].split()[:3]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state not in (b"Z", b"X"):
            table.append((int(name), int(ppid), int(group)))
    return table


def _below(root: int, table: list[tuple[int, int, int]]) -> set[int]:
    """The processes of ``table`` below ``root`` (its children, theirs, ...) or in its process
    group, and theirs, ``root`` left out."""
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in table:
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, _, group in table if group == root}
    todo = [root, *found]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(root)
    return found


def _end_below(root: int) -> None:
    """SIGKILL every process below ``root`` or in its group (see :func:`_below`) while
    ``root`` is still there to hold them, again until none runs (one may fork as it dies).
    A pid read from the table is signalled microseconds later, while the process it named is
    still unreaped below ``root`` (only its parent, in that tree, could reap it meanwhile)."""
    for _ in range(20):
        table = _processes()
        below = set() if table is None else _below(root, table)
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.005)


def _end_group_on_signal(signum: int, frame: FrameType | None) -> None:
    _end_group()


def _end_group() -> None:
    """The worker's last act: SIGKILL every process below it (see :func:`_end_below`), reap
    those that were its children, then SIGKILL its process group, itself included, so that
    nothing its target forked outlives it, even when the parent was killed (the worker then
    reads the end of the pipe).  Its answers are in the pipe already; its output is flushed
    first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed by the target, or None
            pass
    _end_below(os.getpid())
    try:  # no zombie left to an init that may never reap it
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except (ChildProcessError, AttributeError):
        pass
    if not hasattr(os, "killpg") or os.getpgrp() != os.getpid():
        return  # not a group of its own: the group is its parent's
    os.killpg(os.getpid(), signal.SIGKILL)


def _kill(proc: _Process) -> None:
    """SIGKILL what the worker ``proc`` started (see :func:`_end_below`: those that left its
    group too, while the worker still holds them), its process group (what is left, and the
    worker), then the worker itself (should it have left that group)."""
    pgid = proc.pid
    if not proc.reaped:  # else its pid, whose tree this would walk, may be another's by now
        _end_below(pgid)
    if hasattr(os, "killpg") and pgid not in (None, 0, 1, os.getpgrp()):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # no such group (any more)
    try:
        proc.kill()
    except (OSError, ValueError, AttributeError):
        pass


def _exited(proc: _Process, timeout: float) -> None:
    """Wait up to ``timeout`` for the worker ``proc`` to exit, without reaping it: until it is
    reaped its pid, its process group's id, is no one else's, so :func:`_kill` cannot reach
    another process's group."""
    deadline = time.monotonic() + timeout
    if not hasattr(os, "waitid"):
        proc.join(timeout)
        return
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # reaped already
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _reap(proc: _Process, result: str | None) -> None:
    """Wait for a worker told to stop, then kill its process group (whatever its target
    forked, and the worker if it lingers) and reap it.  Then unlink ``result``, the block a
    call still unanswered may have left: only now can the worker not create it."""
    _exited(proc, 0.5)
    _kill(proc)
    proc.join(5)
    _LIVE.pop(proc.pid, None)
    _unlink(result)


def _end_all() -> None:
    """Kill every worker of this process with whatever its target forked, wait for each to
    be gone (it can create no block then), and unlink every shared block made for them."""
    procs = list(_LIVE.values())
    for proc in procs:
        _kill(proc)
    for proc in procs:
        try:
            proc.join(2)
        except (OSError, ValueError, AssertionError):
            pass
        _LIVE.pop(proc.pid, None)
    for name in list(_BLOCKS):
        _unlink(name)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """End the workers, then die of ``signum`` as its default action would have."""
    _end_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # pragma: no cover - the signal ends the process first


def _after_fork_in_child() -> None:
    """A process forked from this one (a worker's target forking, or a program that forks
    after a check) started none of these workers and ends none of them; its signals do what
    they did before tyingspec's handlers (a worker's SIGTERM ends the group the worker
    leads, which a child of the worker does not)."""
    _LIVE.clear()
    _BLOCKS.clear()
    for name in _ENDING:
        signum = getattr(signal, name, None)
        try:
            if signum is not None and \
                    signal.getsignal(signum) in (_on_signal, _end_group_on_signal):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def install_signal_cleanup() -> None:
    """Make this process end its workers, and whatever their targets forked, however it ends:
    at exit (which an uncaught KeyboardInterrupt reaches) and on SIGTERM, SIGHUP or a SIGINT
    reset to the default, which would otherwise end it without a word to them (a worker has
    a process group of its own, out of reach of the terminal's signals).  A signal that has a
    handler already (someone else's) or is ignored is left alone.  Called at each launch of
    a worker; only the main thread can install signal handlers, so a launch from another
    thread leaves them to a later one."""
    if not _installed["atexit"]:
        _installed["atexit"] = True
        # nothing else ends the workers at exit (they are no multiprocessing children), nor
        # what their targets forked
        atexit.register(_end_all)
    if _installed["signals"] or threading.current_thread() is not threading.main_thread():
        return
    _installed["signals"] = True
    for name in _ENDING:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _on_signal)
        except (OSError, ValueError):
            pass


def _exc_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


class _Process:
    """A worker started by :func:`_start`, with what this module uses of a
    ``multiprocessing.Process``: ``exitcode`` is None while it runs, its status once it has
    exited, minus the signal's number when a signal killed it."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def reaped(self) -> bool:
        """Whether it has been waited for (what :meth:`is_alive` does once it has exited)."""
        return self._popen.returncode is not None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self._popen.kill()  # no signal once reaped: its pid may be another process's by then

    def terminate(self) -> None:
        self._popen.terminate()


#: What ``python -c`` runs in the worker (:mod:`engine.worker`, named here as a string so that
#: this module does not import the worker's, which imports this one).  ``sys`` is built in: the
#: parent's ``sys.path`` is in place before anything is imported from a path (the ``''`` that
#: ``-c`` puts first is gone with it).
BOOTSTRAP = ("import sys; sys.path[:] = sys.argv[3:]; "
             "from tyingspec._src.engine.worker import main; main(sys.argv[1], sys.argv[2])")


def _start(spec: str, kind: str, paths: tuple[str, ...],
           timeout: float = DEFAULT_TIMEOUT) -> tuple[_Process, Connection]:
    """Start a worker for ``spec`` (see :mod:`engine.worker`) and return it with this
    process's end of the connection to it."""
    from multiprocessing import resource_tracker


    parent, child = multiprocessing.Pipe()  # a socket pair: the same channel spawn gave
    # the tracker of this process's shared blocks, which the worker registers its own with (as
    # a spawned child did): started here if it is not yet
    tracker = resource_tracker.getfd()
    fds = (child.fileno(),) if tracker is None else (child.fileno(), tracker)
    # the interpreter's own options (-O, -W, -X, -I, ...) as a spawned child had them
    flags: list[str] = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    where = [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))]
    try:
        popen = subprocess.Popen(
            [sys.executable, *flags, "-c", BOOTSTRAP, str(child.fileno()),
             str(-1 if tracker is None else tracker), *where],
            stdin=subprocess.DEVNULL, pass_fds=fds,
            # the call's budget, for a kind that must end its own processes within it (the
            # distributed kind names the rank that hung before this timeout ends the worker)
            env={**os.environ, "TYINGSPEC_CALL_TIMEOUT": f"{timeout:g}"},
            # a group of its own from the start, which no Ctrl-C of the terminal reaches;
            # _kill can end it (and what the target forks) before the worker has run a line
            process_group=0)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    proc = _Process(popen)
    _LIVE[proc.pid] = proc
    try:
        # the rest of what the worker needs comes by the pipe; its sys.argv is this process's,
        # for a target that reads it as it imports, as under spawn
        parent.send((spec, kind, paths, list(sys.argv)))
    except BaseException:
        parent.close()
        _reap(proc, None)
        raise
    return proc, parent


#: A worker started before this process loaded numpy and the rest of tyingspec (see
#: :func:`launch_early`), by the (spec, kind, paths, timeout) it was started for.
_EARLY: dict[tuple[str, str, tuple[str, ...], float], tuple[_Process, Connection]] = {}


def launch_early(spec: str, kind: str, paths: tuple[str, ...],
                 timeout: float = DEFAULT_TIMEOUT) -> None:
    """Start now the worker that ``Worker(spec, kind, timeout, paths).launch()`` would start
    later.  The command knows its target from its arguments before it has loaded numpy and
    the modules of a check (0.2 s of a cold check on a 2-core VM), and the worker's import of
    the target is the longest part of a check's start.  The first :meth:`Worker.launch` for the
    same target takes it over, and any other launch ends it; one never taken is ended with the
    process, like every worker."""
    install_signal_cleanup()
    _EARLY[(spec, kind, tuple(paths), float(timeout))] = _start(spec, kind, tuple(paths),
                                                                 timeout)


def _early(key: tuple[str, str, tuple[str, ...], float]) -> tuple[_Process, Connection] | None:
    """The early worker started for ``key``, if any; an early worker for another target (the
    command's guess of its arguments was wrong) is ended here."""
    found = _EARLY.pop(key, None)
    for proc, conn in list(_EARLY.values()):
        conn.close()
        _kill(proc)
        proc.join(5)
        _LIVE.pop(proc.pid, None)
    _EARLY.clear()
    return found


@dataclass(eq=False)
class Worker:
    """A persistent worker process for one target; restarted after a crash or a timeout."""

    spec: str
    kind: str
    timeout: float = DEFAULT_TIMEOUT
    paths: tuple[str, ...] = ()  # put first on the worker's sys.path (where user code lives)
    signature_problem: str | None = None
    fits: list[str] = field(default_factory=list)
    # the files the running worker's code came from, each with its digest as it was read
    # (see :class:`_Sources`): what :meth:`current` compares with the files as they are
    sources: dict[str, str] = field(default_factory=dict)
    _proc: _Process | None = None
    _conn: Connection | None = None
    _loading: float | None = None  # the load's deadline while its answer is still to come
    _running: float | None = None  # a submitted call's deadline while its answer is to come
    _pool: list[Any] = field(default_factory=list)  # blocks this process made for inputs
    # the call in flight: its inputs, and the block of the pool each large one was written to
    _sent: tuple[Mapping[str, Any], dict[str, Any]] | None = None
    _result: str | None = None  # the name of its result block, until its answer is read
    # result blocks taken from this worker whose dE has gone here, by name, with this process's
    # mapping of each (oldest first): offered to the worker for the next results
    _results: dict[str, Any] = field(default_factory=dict)
    _offered: tuple[str, ...] = ()  # those offered for the call in flight
    _dropped: list[str] = field(default_factory=list)  # let go here: the worker closes them
    # inputs written ahead of their call (:meth:`stage`): the inputs, the message, the blocks
    _staged: tuple[Mapping[str, Any], dict[str, Any], dict[str, Any]] | None = None

    def launch(self) -> None:
        """Start the worker and let it import the target while this process goes on; the
        answer is :meth:`wait_loaded`'s (every call waits for it first)."""
        install_signal_cleanup()
        self._results.clear()  # a worker's result blocks are its own; a new one holds none
        self._offered, self._dropped = (), []
        self.sources = {}  # a new worker reads its code afresh
        proc, parent = _early((self.spec, self.kind, tuple(self.paths), float(self.timeout))) \
            or _start(self.spec, self.kind, self.paths, self.timeout)
        self._proc, self._conn = proc, parent
        self._loading = time.monotonic() + LOAD_TIMEOUT

    def wait_loaded(self, *, block: bool = True) -> bool:
        """Wait for the import and signature check; AdapterError when they failed.  With
        ``block=False`` only an answer already there is read: False while none is."""
        if self._loading is None:
            return True
        if not block and not self._answered():
            return False
        reply = self._receive(self._loading, LOAD_TIMEOUT, "importing the target",
                              _loaded_answer)
        self._loading = None
        if reply[0] == "error":
            self.stop()
            raise reply[1]
        _, self.signature_problem, self.fits, found = reply
        self.sources.update(found)
        return True

    def start(self) -> None:
        """Start the worker and import the target; AdapterError when that fails."""
        self.launch()
        self.wait_loaded()

    def _answered(self) -> bool:
        assert self._conn is not None
        try:
            return bool(self._conn.poll(0))
        except (EOFError, OSError):
            return True  # the worker is gone: reading says how

    def _receive(self, deadline: float, timeout: float, during: str,
                 form: Callable[[Any], Any]) -> Any:
        """The worker's next answer, decoded (never unpickled) and of the ``form`` expected
        (see :func:`_loaded_answer`); AdapterError when it timed out, died or sent anything
        else (then the worker is killed)."""
        from tyingspec._src.core.adapters import AdapterError

        assert self._conn is not None and self._proc is not None
        while True:
            left = deadline - time.monotonic()
            try:  # one look even past the deadline: the answer may have come meanwhile
                ready = self._conn.poll(min(max(left, 0.0), 0.5))
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    frame = self._conn.recv_bytes()
                except (EOFError, OSError):
                    self._proc.join(5)
                    raise self._ended(during) from None
                try:
                    return form(_decode(frame))
                except _Refused as exc:
                    raise self._refused(during, str(exc)) from None
            if not self._proc.is_alive():
                raise self._ended(during)
            if left <= 0:
                self.stop()
                raise AdapterError(self.spec, f"timed out after {timeout:g} s while {during}",
                                   expected="a result within --timeout",
                                   got="no answer; the worker was killed")

    def _refused(self, during: str, what: str) -> Exception:
        """The worker sent what the parent does not take: stop it (the next call gets a
        fresh one) and say what was refused."""
        from tyingspec._src.core.adapters import AdapterError

        self.stop()
        return AdapterError(self.spec, f"the worker sent a message the parent refused while "
                            f"{during}", expected="plain data in tyingspec's message format",
                            got=f"{what}; the worker was killed")

    def _ended(self, during: str) -> Exception:
        """The worker is gone: stop what is left of it and say how it ended."""
        from tyingspec._src.core.adapters import AdapterError

        code = None if self._proc is None else self._proc.exitcode
        self.stop()
        return AdapterError(self.spec, f"the worker process {_describe_exit(code)} while "
                            f"{during}", expected="a returned result",
                            got="no result (the process ended)")

    def stage(self, inputs: Mapping[str, Any]) -> None:
        """Write the large arrays of ``inputs`` into blocks now, for the call :meth:`submit`
        will send on these same arrays, unchanged (the first call, while the worker imports
        its target: the blocks are made and filled off the critical path, 0.15 s of a
        GPT-2-size E)."""
        self._staged = (inputs, *self._written(inputs))

    def _written(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``inputs`` with each large array written into a block of this process's pool: a
        block of the same size is reused (already mapped and faulted in), the others go; and
        the block each went into."""
        free, written = list(self._pool), {}
        message: dict[str, Any] = {}
        for k, v in inputs.items():
            if not _large(v):
                message[k] = v
                continue
            block = next((b for b in free if b.size == v.nbytes), None)
            if block is None:
                # filled as a result is (the comparison after the call then faults this
                # process's mapping in: 0.010 CPU seconds more for a GPT-2-size E)
                block = _create(v.nbytes, populate=False)
                _BLOCKS.add(block.name)
                message[k] = _write_result(v, block)
            else:
                free.remove(block)
                message[k] = _write(v, block)
            written[k] = block
        _release(free, unlink=True)
        self._pool = list(written.values())
        return message, written

    def _message(self, inputs: Mapping[str, Any]
                 ) -> tuple[str, dict[str, Any], tuple[str, ...], tuple[str, ...], int]:
        """A fresh name for the call's result block, ``inputs`` with each large array written
        into a block of the pool (or as :meth:`stage` wrote them, for the same arrays), the
        result blocks the worker may write the result into instead (see :meth:`_returned`),
        those it is to close, and the largest new one it is to keep open for later calls.
        Which block each input went into is kept for :meth:`collect`."""
        staged, self._staged = self._staged, None
        if staged is not None and _same_arrays(staged[0], inputs):
            message, written = staged[1], staged[2]
        else:
            message, written = self._written(inputs)
        self._sent = (inputs, written)
        self._result = f"tyingspec_{secrets.token_hex(8)}"
        _BLOCKS.add(self._result)
        free = list(self._results.items())  # one step: a lease may add to it on any thread
        total = sum(len(m) for _, m in free)
        for name, mapping in free:  # the oldest go first, down to RESULTS_KEPT
            if total <= RESULTS_KEPT:
                break
            del self._results[name]
            self._dropped.append(name)
            total -= len(mapping)
        self._offered = tuple(self._results)
        dropped, self._dropped = tuple(self._dropped), []
        return self._result, message, self._offered, dropped, RESULTS_KEPT // 2

    def _returned(self, name: str) -> Callable[[Any], None]:
        """Where this process's mapping of the result block ``name`` goes once the dE in it
        has gone: among the blocks offered to the worker that wrote it (not to a worker
        started since, which does not hold it)."""
        me, proc = weakref.ref(self), self._proc

        def give_back(mapping: Any) -> None:
            worker = me()
            if worker is None or worker._proc is not proc or proc is None:
                return
            kept = sum(len(m) for m in list(worker._results.values()))
            if len(mapping) <= RESULTS_KEPT // 2 and kept + len(mapping) <= RESULTS_KEPT:
                worker._results[name] = mapping
            else:  # unmapped here as it goes; the worker closes it with the next call
                worker._dropped.append(name)

        return give_back

    def submit(self, inputs: Mapping[str, Any]) -> None:
        """Send one call of the target on ``inputs`` to the worker (started or restarted
        first, as needed); :meth:`collect` waits for its answer, within the timeout."""
        if self._loading is not None:
            self.wait_loaded()  # an import error is read even when the worker has exited
        if self._proc is None or not self._proc.is_alive():
            self.start()
        assert self._conn is not None
        message = self._message(inputs)
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            self.stop()
            self.start()
            message = self._message(inputs)
            assert self._conn is not None
            self._conn.send(message)
        self._running = time.monotonic() + self.timeout

    def collect(self) -> Any:
        """The answer to the call :meth:`submit` sent: the validated result (its dE taken over
        from the worker's block, and the inputs written over in their blocks added to its
        ``mutated``), or the AdapterError it raised."""
        assert self._running is not None and self._sent is not None
        deadline, self._running = self._running, None
        (inputs, written), self._sent = self._sent, None
        # no answer (a timeout, a dead worker, a refused one): stop() has reaped the worker
        # and unlinked the result block, or will (an interrupt)
        status, payload, kept, found = self._receive(deadline, self.timeout, "running the call",
                                                     _call_answer)
        self.sources.update(found)
        result, self._result = self._result, None
        try:
            if status == "error":
                raise payload
            returned = payload
            changed = _written_over(inputs, written)
            if changed:  # named in the inputs' order, as the worker names the others
                names = changed | set(returned.mutated)
                returned = replace(returned, mutated=tuple(k for k in inputs if k in names))
            if isinstance(returned.dE, _Shared):
                name, offered, self._offered = returned.dE.name, self._offered, ()
                again = self._results.pop(name, None) if name in offered else None
                if name != result and again is None:  # another block: an input's, anyone's
                    raise self._refused("running the call", f"a result in the block "
                                        f"{name!r}, not the call's {result!r}")
                try:
                    dE = _take(returned.dE, self._returned(name)) if again is None else \
                        _taken_again(returned.dE, again, self._returned(name))
                except _Refused as exc:
                    raise self._refused("running the call", str(exc)) from None
                returned = replace(returned, dE=dE)
                if again is None:
                    result = None  # taken: its name is unlinked
        finally:
            _unlink(result)  # a block the worker made before it failed, or one not taken
            self._retire(kept)
        return returned

    def _retire(self, names: set[str]) -> None:
        """Take the blocks ``names`` out of the pool: the adapter keeps views of them as its
        own copies of its inputs, which the next call's inputs must not be written over (the
        worker keeps them mapped; unlinked here, they go when those views go)."""
        if names:
            _release([b for b in self._pool if b.name in names], unlink=True)
            self._pool = [b for b in self._pool if b.name not in names]

    def current(self) -> bool:
        """Whether the worker runs, loaded, and every file its code came from (:attr:`sources`)
        still holds what it held when read: a check may then reuse it."""
        proc = self._proc
        return proc is not None and proc.is_alive() and self._loading is None and \
            unchanged(self.sources)

    def strays(self) -> bool:
        """Whether a process the worker's code started still runs: a child its target forked
        and left (or one that left the worker's process group)."""
        proc = self._proc
        if proc is None or not proc.is_alive():
            return False
        table = _processes()
        return table is not None and bool(_below(proc.pid, table))

    def outranks(self) -> bool:
        """Whether the worker runs at a higher scheduling priority than this thread (the
        command gives way to its worker: ``front.entry.NICE``).  Then what this process does
        while the worker runs a call takes only what the call leaves of the cores."""
        proc = self._proc
        if proc is None or not proc.is_alive():
            return False
        try:
            return os.getpriority(os.PRIO_PROCESS, proc.pid) < os.getpriority(os.PRIO_PROCESS, 0)
        except (AttributeError, OSError):  # no priorities here, or the worker just exited
            return False

    def invoke(self, inputs: Mapping[str, Any]) -> Any:
        """One call of the target on ``inputs`` in the worker; restarts a dead worker first."""
        self.submit(inputs)
        return self.collect()

    def stop(self, *, wait: bool = True) -> None:
        """End the worker (politely, then by force) and free the shared blocks.  With
        ``wait=False`` a background thread waits for the exit (a torch worker takes ~0.3 s
        to finalise) and kills a worker that lingers; the process is never left behind: this
        process ends it at exit (see :func:`install_signal_cleanup`)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._loading = self._running = None
        self._sent = self._staged = None
        result, self._result = self._result, None
        self._results.clear()  # the worker that held them is ending
        self._offered, self._dropped = (), []
        if conn is not None:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError, ValueError):
                pass
            conn.close()
        _release(self._pool, unlink=True)
        if proc is None:
            return
        if wait:
            _reap(proc, result)
        else:
            threading.Thread(target=_reap, args=(proc, result),
                             name=f"tyingspec-reap:{self.spec}", daemon=True).start()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass
