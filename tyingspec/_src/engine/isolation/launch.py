"""Launching: starting a worker process, and the one the command starts before numpy loads.

A worker is a fresh interpreter running :mod:`engine.worker` with this process's ``sys.path``
(set before it imports anything), working directory and ``sys.argv``; unlike a ``spawn`` child
it never imports this process's ``__main__``, so a user's script needs no ``__main__`` guard.
:func:`launch_early` starts the command's worker before this process loads numpy; the first
matching :meth:`Worker.launch` takes it over.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from multiprocessing.connection import Connection

from tyingspec._src.core.options import DEFAULT_TIMEOUT
from tyingspec._src.core.process_state import WORKER_ENV
from tyingspec._src.engine.isolation.processes import (
    _LIVE,
    _kill,
    _Process,
    _reap,
    install_signal_cleanup,
)

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
            # distributed kind names the rank that hung before this timeout ends the worker),
            # and the mark of a worker (core.process_state.in_worker)
            env={**os.environ, "TYINGSPEC_CALL_TIMEOUT": f"{timeout:g}", WORKER_ENV: "1"},
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
