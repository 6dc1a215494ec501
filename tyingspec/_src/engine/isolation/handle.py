"""The worker: this process's handle on one target's persistent worker process.

:class:`Worker` starts the worker (or takes over the early one), sends each call's inputs
(large ones written into shared blocks), waits with a timeout for the decoded answer and
validates its form, takes a large dE over from its block, and restarts a worker that crashed,
exited, hung or sent what the parent refuses: that call becomes an AdapterError, the remaining
cases run.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from tyingspec._src.core.options import DEFAULT_TIMEOUT
from tyingspec._src.engine.isolation.blocks import (
    _BLOCKS,
    RESULTS_KEPT,
    _create,
    _large,
    _release,
    _same_arrays,
    _take,
    _taken_again,
    _unlink,
    _write,
    _write_result,
    _written_over,
)
from tyingspec._src.engine.isolation.launch import _early, _start
from tyingspec._src.engine.isolation.processes import (
    _below,
    _describe_exit,
    _Process,
    _processes,
    _reap,
    install_signal_cleanup,
)
from tyingspec._src.engine.isolation.sources import unchanged
from tyingspec._src.engine.isolation.wire import (
    _call_answer,
    _decode,
    _loaded_answer,
    _Refused,
    _Shared,
)

#: Seconds the import and signature check of a target may take.
LOAD_TIMEOUT = 120.0


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
