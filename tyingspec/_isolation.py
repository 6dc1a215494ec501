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
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

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


#: ``madvise`` advice (Linux 5.14+) that maps a whole block in with one call.  Touching a fresh
#: mapping of a 154 MB block page by page costs ~0.4 s of page faults on a VM, populating it
#: ~0.01 s; where the advice is unknown the pages fault in on first use, as before.
_POPULATE_READ, _POPULATE_WRITE = 22, 23


def _populate(block: Any, *, write: bool) -> None:
    advise = getattr(getattr(block, "_mmap", None), "madvise", None)
    if advise is None or not sys.platform.startswith("linux"):
        return
    try:
        advise(_POPULATE_WRITE if write else _POPULATE_READ)
    except (OSError, ValueError):
        pass


def _large(a: Any) -> bool:
    import numpy as np

    return isinstance(a, np.ndarray) and a.nbytes >= SHARE_ABOVE and not a.dtype.hasobject


def _create(nbytes: int) -> Any:
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=nbytes)
    _populate(block, write=True)
    return block


def _write(a: Any, block: Any) -> _Shared:
    import numpy as np

    np.copyto(np.ndarray(a.shape, dtype=a.dtype, buffer=block.buf), a, casting="no")
    return _Shared(block.name, tuple(a.shape), a.dtype.str)


def _attach(name: str, attached: dict[str, Any]) -> Any:
    """The block ``name``, mapped once and kept: the same blocks come back call after call, and
    a mapping already faulted in costs nothing the next time."""
    block = attached.get(name)
    if block is None:
        from multiprocessing import shared_memory

        block = attached[name] = shared_memory.SharedMemory(name=name)
        _populate(block, write=False)
    return block


def _view(x: Any, attached: dict[str, Any]) -> Any:
    """The array behind a :class:`_Shared` (a view into its block), else ``x`` itself."""
    if not isinstance(x, _Shared):
        return x
    import numpy as np

    return np.ndarray(x.shape, dtype=np.dtype(x.dtype), buffer=_attach(x.name, attached).buf)


def _release(blocks: Any, *, unlink: bool) -> None:
    """Close (and unlink) every block of ``blocks`` (a list, or a dict's values), then empty
    it.  A block still viewed somewhere stays mapped until its views go."""
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


def _forget(attached: dict[str, Any], keep: set[str]) -> None:
    """Close the attached blocks the other process no longer sends (it has unlinked them)."""
    gone = {n: b for n, b in attached.items() if n not in keep}
    for name in gone:
        del attached[name]
    _release(gone, unlink=False)


def _unlink(name: str) -> None:
    """Unlink a block a worker created and could not unlink itself (it was killed)."""
    from multiprocessing import shared_memory

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
    result: list[Any] = []  # the block dE goes back in, reused while its size holds
    try:
        _answer(conn, spec, fn, table, attached, result)
    finally:
        _release(attached, unlink=False)
        _release(result, unlink=True)


def _answer(conn: Connection, spec: str, fn: Any, table: Any, attached: dict[str, Any],
            result: list[Any]) -> None:
    """Answer calls until told to stop.  The parent copies a result out of its block before it
    sends the next call, so the block is free again whenever a call arrives."""
    from ._adapters import AdapterError

    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        _forget(attached, {v.name for v in message.values() if isinstance(v, _Shared)})
        inputs = {k: _view(v, attached) for k, v in message.items()}
        try:
            returned = table.invoke(spec, fn, inputs)
            inputs = {}  # the views into the parent's blocks go before the blocks can close
            dE = returned.dE
            if _large(dE):
                if not result or result[0].size < dE.nbytes:
                    _release(result, unlink=True)
                    result.append(_create(dE.nbytes))
                returned = replace(returned, dE=_write(dE, result[0]))
            conn.send(("ok", returned))
        except AdapterError as exc:
            conn.send(("error", exc))
        except BaseException as exc:  # noqa: BLE001  (SystemExit, KeyboardInterrupt, ...)
            conn.send(("error", AdapterError(spec, "raised an exception",
                                             got=_exc_text(exc))))
        finally:
            inputs = {}


def _reap(proc: Any) -> None:
    """Wait for a worker told to stop; kill it if it lingers."""
    proc.join(0.5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


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
    _results: dict[str, Any] = field(default_factory=dict)  # the worker's result blocks

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

    def _message(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``inputs`` with each large array written into a block of this process's pool: a
        block of the same size is reused (already mapped and faulted in), the others go."""
        free, used = list(self._pool), []
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
            used.append(block)
            message[k] = _write(v, block)
        _release(free, unlink=True)
        self._pool = used
        return message

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
        """The answer to the call :meth:`submit` sent: the validated result (its dE copied out
        of the worker's block), or the AdapterError it raised."""
        assert self._running is not None
        deadline, self._running = self._running, None
        reply = self._receive(deadline, self.timeout, "running the call")
        if reply[0] == "error":
            raise reply[1]
        returned = reply[1]
        if isinstance(returned.dE, _Shared):
            import numpy as np

            shared = returned.dE
            try:
                view = _view(shared, self._results)
                dE = np.array(view, copy=True)  # the worker reuses the block for its next call
                del view
            finally:
                _forget(self._results, {shared.name})
            returned = replace(returned, dE=dE)
        return returned

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
        if conn is not None:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError, ValueError):
                pass
            conn.close()
        # unlinked now, mapped or not: a worker that is killed cannot unlink its result block
        # itself, and one that exits finds it gone (both fine)
        names = list(self._results)
        _release(self._results, unlink=False)
        for name in names:
            _unlink(name)
        _release(self._pool, unlink=True)
        if proc is None:
            return
        if wait:
            _reap(proc)
        else:
            threading.Thread(target=_reap, args=(proc,), name=f"tyingspec-reap:{self.spec}",
                             daemon=True).start()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass
