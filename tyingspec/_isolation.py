"""User code runs in a worker process: its crash, exit or hang ends a case, never the run.

A ``module:attr`` target is imported and called in one persistent worker process (started with
``spawn``, so nothing of tyingspec's own state leaks into it).  The parent sends the inputs of a
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
are never touched.  A large dE comes back in a new block that the parent takes over as it is.
"""

from __future__ import annotations

import copy
import faulthandler
import multiprocessing as mp
import secrets
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from . import _memory as memory
from ._options import DEFAULT_TIMEOUT

__all__ = ["DEFAULT_TIMEOUT", "Worker"]
#: Seconds the import and signature check of a target may take.
LOAD_TIMEOUT = 120.0


#: Arrays at least this large cross the pipe through shared memory (one copy each way) instead
#: of being pickled (several): at V = 50257 that is most of the isolation's cost.
SHARE_ABOVE = 1 << 20


@dataclass(frozen=True)
class _Shared:
    """An array left in a named shared-memory block for the other process."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def _large(a: Any) -> bool:
    import numpy as np

    return isinstance(a, np.ndarray) and a.nbytes >= SHARE_ABOVE and not a.dtype.hasobject


def _create(nbytes: int, name: str | None = None) -> Any:
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    memory.populate(block, write=True)
    return block


def _take(shared: _Shared) -> Any:
    """The array the worker left in the block ``shared.name``, made this process's own without
    a copy: the array owns a mapping of the block, whose name is unlinked at once, so its
    memory goes with the array.  (Copying it out instead writes a fresh [V, d] array: 0.1-0.6 s
    of page faults at GPT-2 size on a VM, where mapping the populated block takes ~0.01 s.)"""
    import mmap
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=shared.name)
    try:
        # a mapping of the array's own: the block's goes when the block is closed, even
        # under an array viewing it, so its descriptor is mapped again
        mapping = mmap.mmap(block._fd, block.size)  # type: ignore[attr-defined]
    finally:
        block.close()
        block.unlink()
    return memory.over(mapping, shared.shape, shared.dtype, write=False)


def _in_block(a: Any, block: Any) -> Any:
    """The array of ``a``'s shape and dtype that ``block`` holds (or is to hold)."""
    import numpy as np

    return np.ndarray(a.shape, dtype=a.dtype, buffer=block.buf)


def _write(a: Any, block: Any) -> _Shared:
    import numpy as np

    np.copyto(_in_block(a, block), a, casting="no")
    return _Shared(block.name, tuple(a.shape), a.dtype.str)


def _attach(name: str, attached: dict[str, Any]) -> Any:
    """The block ``name``, mapped once and kept: the same blocks come back call after call, and
    a mapping already faulted in costs nothing the next time."""
    block = attached.get(name)
    if block is None:
        from multiprocessing import shared_memory

        block = attached[name] = shared_memory.SharedMemory(name=name)
        memory.populate(block, write=False)
    return block


def _view(x: Any, attached: dict[str, Any]) -> Any:
    """The array behind a :class:`_Shared` (a view into its block), else ``x`` itself."""
    if not isinstance(x, _Shared):
        return x
    import numpy as np

    return np.ndarray(x.shape, dtype=np.dtype(x.dtype), buffer=_attach(x.name, attached).buf)


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
            try:
                block.unlink()
            except (FileNotFoundError, OSError):
                pass
    blocks.clear()


def _written_over(inputs: Mapping[str, Any], written: Mapping[str, Any]) -> set[str]:
    """The inputs sent through shared memory (``written``: the block each went into) whose
    block no longer holds, bit for bit, what this process wrote there.  The worker hands those
    to the adapter uncopied (see :class:`~tyingspec._adapters.PrivateInputs`): its write into
    one shows here, and the caller's own array never saw it."""
    from ._adapters import same_bits

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


def _serve(conn: Connection, spec: str, kind: str, paths: tuple[str, ...]) -> None:
    """The worker's loop: import the target once, then answer calls until told to stop."""
    faulthandler.enable()

    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    from ._adapters import AdapterError, resolve, signature_problem
    from ._kinds import KINDS

    table = KINDS[kind]  # type: ignore[index]
    try:
        fn = resolve(spec, kind)
        problem = signature_problem(fn, table.positional, table.keywords)
        fits = [k for k, t in KINDS.items()
                if k != kind and signature_problem(fn, t.positional, t.keywords) is None]
        conn.send(("loaded", problem, fits))
    except AdapterError as exc:
        conn.send(("error", exc))
        return
    except BaseException as exc:  # noqa: BLE001  (SystemExit at import included)
        conn.send(("error", AdapterError(spec, "import raised", got=_exc_text(exc))))
        return
    attached: dict[str, Any] = {}  # the parent's blocks, mapped once
    try:
        _answer(conn, spec, fn, table, attached)
    finally:
        _release(attached, unlink=False)


def _answer(conn: Connection, spec: str, fn: Any, table: Any, attached: dict[str, Any]
            ) -> None:
    """Answer calls until told to stop.  A large dE goes back in a new block, under the name
    the parent chose for the call: the parent takes the block over, and can unlink that name
    whatever becomes of this process."""
    from ._adapters import AdapterError

    # blocks the adapter kept a view of, each with a weak reference to that view: mapped while
    # it is alive (closing a block unmaps it under any array still viewing it)
    held: list[tuple[Any, Any]] = []
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
            reply, block = _call(spec, fn, table, message, attached, held)
            try:
                conn.send(reply)
            except Exception as exc:  # noqa: BLE001  (a result that does not pickle)
                conn.send(("error", AdapterError(spec, "raised an exception",
                                                 got=_exc_text(exc)), reply[2]))
            finally:
                if block is not None:  # sent or not, it is the parent's to unlink
                    block.close()
    finally:
        _release([b for b, _ in held], unlink=False)


def _call(spec: str, fn: Any, table: Any, message: tuple[str, dict[str, Any]],
          attached: dict[str, Any], held: list[tuple[Any, Any]]
          ) -> tuple[tuple[str, Any, set[str]], Any]:
    """One call on what the parent sent (the result block's name, the inputs): the reply
    (``"ok"`` and the result, or ``"error"`` and the AdapterError; and the names of the blocks
    whose views the adapter kept) and the block dE went into, if any."""
    from ._adapters import AdapterError, PrivateInputs

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
            block = _create(returned.dE.nbytes, result)
            returned = replace(returned, dE=_write(returned.dE, block))
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


def _reap(proc: Any, result: str | None) -> None:
    """Wait for a worker told to stop; kill it if it lingers.  Then unlink ``result``, the
    block a call still unanswered may have left: only now can the worker not create it."""
    proc.join(0.5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    _unlink(result)


def _exc_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


@dataclass(eq=False)
class Worker:
    """A persistent worker process for one target; restarted after a crash or a timeout."""

    spec: str
    kind: str
    timeout: float = DEFAULT_TIMEOUT
    paths: tuple[str, ...] = ()  # put first on the worker's sys.path (where user code lives)
    signature_problem: str | None = None
    fits: list[str] = field(default_factory=list)
    _proc: Any = None
    _conn: Connection | None = None
    _loading: float | None = None  # the load's deadline while its answer is still to come
    _running: float | None = None  # a submitted call's deadline while its answer is to come
    _pool: list[Any] = field(default_factory=list)  # blocks this process made for inputs
    # the call in flight: its inputs, and the block of the pool each large one was written to
    _sent: tuple[Mapping[str, Any], dict[str, Any]] | None = None
    _result: str | None = None  # the name of its result block, until its answer is read

    def launch(self) -> None:
        """Start the worker and let it import the target while this process goes on; the
        answer is :meth:`wait_loaded`'s (every call waits for it first)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.spec, self.kind, self.paths),
                           daemon=True, name=f"tyingspec-worker:{self.spec}")
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self._loading = time.monotonic() + LOAD_TIMEOUT

    def wait_loaded(self, *, block: bool = True) -> bool:
        """Wait for the import and signature check; AdapterError when they failed.  With
        ``block=False`` only an answer already there is read: False while none is."""
        if self._loading is None:
            return True
        if not block and not self._answered():
            return False
        reply = self._receive(self._loading, LOAD_TIMEOUT, "importing the target")
        self._loading = None
        if reply[0] == "error":
            self.stop()
            raise reply[1]
        _, self.signature_problem, self.fits = reply
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

    def _receive(self, deadline: float, timeout: float, during: str) -> Any:
        from ._adapters import AdapterError

        assert self._conn is not None and self._proc is not None
        while True:
            left = deadline - time.monotonic()
            try:  # one look even past the deadline: the answer may have come meanwhile
                ready = self._conn.poll(min(max(left, 0.0), 0.5))
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    self._proc.join(5)
                    raise self._ended(during) from None
            if not self._proc.is_alive():
                raise self._ended(during)
            if left <= 0:
                self.stop()
                raise AdapterError(self.spec, f"timed out after {timeout:g} s while {during}",
                                   expected="a result within --timeout",
                                   got="no answer; the worker was killed")

    def _ended(self, during: str) -> Exception:
        """The worker is gone: stop what is left of it and say how it ended."""
        from ._adapters import AdapterError

        code = None if self._proc is None else self._proc.exitcode
        self.stop()
        return AdapterError(self.spec, f"the worker process {_describe_exit(code)} while "
                            f"{during}", expected="a returned result",
                            got="no result (the process ended)")

    def _message(self, inputs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """A fresh name for the call's result block, and ``inputs`` with each large array
        written into a block of this process's pool: a block of the same size is reused
        (already mapped and faulted in), the others go.  Which block each went into is kept
        for :meth:`collect`."""
        free, written = list(self._pool), {}
        message: dict[str, Any] = {}
        for k, v in inputs.items():
            if not _large(v):
                message[k] = v
                continue
            block = next((b for b in free if b.size == v.nbytes), None)
            if block is None:
                block = _create(v.nbytes)
            else:
                free.remove(block)
            written[k] = block
            message[k] = _write(v, block)
        _release(free, unlink=True)
        self._pool = list(written.values())
        self._sent = (inputs, written)
        self._result = f"tyingspec_{secrets.token_hex(8)}"
        return self._result, message

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
        # no answer (a timeout, a dead worker): stop() has reaped the worker and unlinked the
        # result block, or will (an interrupt)
        status, payload, kept = self._receive(deadline, self.timeout, "running the call")
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
                returned = replace(returned, dE=_take(returned.dE))
        except BaseException:
            _unlink(result)  # a block the worker made before it failed, or one not taken
            raise
        finally:
            self._retire(kept)
        return returned

    def _retire(self, names: set[str]) -> None:
        """Take the blocks ``names`` out of the pool: the adapter keeps views of them as its
        own copies of its inputs, which the next call's inputs must not be written over (the
        worker keeps them mapped; unlinked here, they go when those views go)."""
        if names:
            _release([b for b in self._pool if b.name in names], unlink=True)
            self._pool = [b for b in self._pool if b.name not in names]

    def invoke(self, inputs: Mapping[str, Any]) -> Any:
        """One call of the target on ``inputs`` in the worker; restarts a dead worker first."""
        self.submit(inputs)
        return self.collect()

    def stop(self, *, wait: bool = True) -> None:
        """End the worker (politely, then by force) and free the shared blocks.  With
        ``wait=False`` a background thread waits for the exit (a torch worker takes ~0.3 s
        to finalise) and kills a worker that lingers; the process is never left behind: it is
        a daemon, ended with this one."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._loading = self._running = None
        self._sent = None
        result, self._result = self._result, None
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
