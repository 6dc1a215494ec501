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


def _share(a: Any, blocks: list[Any]) -> Any:
    """``a`` as a :class:`_Shared` when it is a large numpy array (the block is appended to
    ``blocks``: its creator unlinks it), else ``a`` itself."""
    import numpy as np

    if not isinstance(a, np.ndarray) or a.nbytes < SHARE_ABOVE or a.dtype.hasobject:
        return a
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(create=True, size=a.nbytes)
    blocks.append(block)
    np.ndarray(a.shape, dtype=a.dtype, buffer=block.buf)[...] = a
    return _Shared(block.name, tuple(a.shape), a.dtype.str)


def _unshare(x: Any, blocks: list[Any], *, copy: bool) -> Any:
    """The array behind a :class:`_Shared` (a view into the attached block, or a copy)."""
    if not isinstance(x, _Shared):
        return x
    from multiprocessing import shared_memory

    import numpy as np

    block = shared_memory.SharedMemory(name=x.name)
    view = np.ndarray(x.shape, dtype=np.dtype(x.dtype), buffer=block.buf)
    if copy:
        out = view.copy()
        del view
        block.close()
        return out
    blocks.append(block)
    return view


def _release(blocks: list[Any], *, unlink: bool) -> None:
    for block in blocks:
        try:
            block.close()
            if unlink:
                block.unlink()
        except (BufferError, FileNotFoundError, OSError):
            pass
    blocks.clear()


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
    import sys

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
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        attached: list[Any] = []
        created: list[Any] = []
        inputs = {k: _unshare(v, attached, copy=False) for k, v in message.items()}
        try:
            returned = table.invoke(spec, fn, inputs)
            del inputs  # the views into the parent's blocks go before the blocks close
            returned = replace(returned, dE=_share(returned.dE, created))
            conn.send(("ok", returned))
        except AdapterError as exc:
            conn.send(("error", exc))
        except BaseException as exc:  # noqa: BLE001  (SystemExit, KeyboardInterrupt, ...)
            conn.send(("error", AdapterError(spec, "raised an exception",
                                             got=_exc_text(exc))))
        finally:
            inputs = {}
            _release(attached, unlink=False)
            # the parent copies the result out before it answers: then this block can go
            if created:
                try:
                    conn.recv()
                except (EOFError, OSError):
                    pass
                _release(created, unlink=True)


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

    def start(self) -> None:
        """Start the worker and import the target; AdapterError when that fails."""
        from ._adapters import AdapterError

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.spec, self.kind, self.paths),
                           daemon=True, name=f"tyingspec-worker:{self.spec}")
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        reply = self._receive(LOAD_TIMEOUT, "importing the target")
        if reply[0] == "error":
            self.stop()
            raise reply[1]
        _, self.signature_problem, self.fits = reply
        _ = AdapterError  # the import above keeps the error type loaded in the parent

    def _receive(self, timeout: float, during: str) -> Any:
        from ._adapters import AdapterError

        assert self._conn is not None and self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise AdapterError(self.spec, f"timed out after {timeout:g} s while {during}",
                                   expected="a result within --timeout",
                                   got="no answer; the worker was killed")
            try:
                ready = self._conn.poll(min(left, 0.5))
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

    def _ended(self, during: str) -> Exception:
        """The worker is gone: stop what is left of it and say how it ended."""
        from ._adapters import AdapterError

        code = None if self._proc is None else self._proc.exitcode
        self.stop()
        return AdapterError(self.spec, f"the worker process {_describe_exit(code)} while "
                            f"{during}", expected="a returned result",
                            got="no result (the process ended)")

    def invoke(self, inputs: Mapping[str, Any]) -> Any:
        """One call of the target on ``inputs`` in the worker; restarts a dead worker first."""
        if self._proc is None or not self._proc.is_alive():
            self.start()
        assert self._conn is not None
        blocks: list[Any] = []
        try:
            message = {k: _share(v, blocks) for k, v in inputs.items()}
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                self.stop()
                self.start()
                assert self._conn is not None
                self._conn.send(message)
            reply = self._receive(self.timeout, "running the call")
        finally:
            _release(blocks, unlink=True)
        if reply[0] == "error":
            raise reply[1]
        returned = reply[1]
        if isinstance(returned.dE, _Shared):
            result: list[Any] = []
            returned = replace(returned, dE=_unshare(returned.dE, result, copy=True))
            assert self._conn is not None
            self._conn.send("copied")  # the worker may now unlink the result's block
        return returned

    def stop(self) -> None:
        """End the worker (politely, then by force)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError, ValueError):
                pass
            conn.close()
        if proc is not None:
            proc.join(0.5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass
