"""Serving: the worker's side, which imports the target once and answers calls until told to stop.

Runs in the worker process (:mod:`engine.worker` hands over to :func:`_serve`).  The target is
imported by :func:`_import_target` (what must run before that import goes there), each call
gets the parent's shared blocks as uncopied views, and each answer goes back as one frame of
the wire format (:mod:`.wire`) with the files the worker's code read since the last
(:mod:`.sources`).  A large dE goes back in a shared block (:mod:`.blocks`).
"""

from __future__ import annotations

import copy
import faulthandler
import sys
import traceback
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from tyingspec._src.engine.isolation.blocks import (
    _create,
    _forget,
    _large,
    _release,
    _view,
    _write_result,
)
from tyingspec._src.engine.isolation.processes import _end_group, _own_group
from tyingspec._src.engine.isolation.sources import _Sources
from tyingspec._src.engine.isolation.wire import _encode, _Shared, _Unsendable


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
    from tyingspec._src.kinds.table import KINDS, fitting

    table = KINDS[kind]
    sources = _Sources()
    sys.addaudithook(sources.opened)  # before the target's import: it sees what that reads
    try:
        fn = _import_target(spec, kind, table)
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


def _import_target(spec: str, kind: str, table: Any) -> Any:
    """Import the target ``spec`` of ``kind`` (``table``: the kind's entry in the kind table)
    and return what it names.  Whatever must run in the worker before the target is imported
    belongs here, before :func:`~kinds.table.resolve`; what it raises is reported as the
    import's error (see :func:`_load_and_answer`)."""
    from tyingspec._src.kinds.table import resolve

    if table.before_import is not None:  # e.g. linear-ce's Triton interpreter, set up first
        table.before_import()
    return resolve(spec, kind)


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


def _exc_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
