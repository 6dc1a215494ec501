"""Processes: no process of a run outlives it.

The worker leads a process group of its own, which whatever its target forks joins, and on
Linux is a child subreaper, so that a process its target forked stays below it even after
leaving that group (a ``setsid()``, a daemon's double fork): the parent ends a worker by killing
every process below it and its group (:func:`_kill`), and a worker that ends (even one whose
parent was killed) does the same last (:func:`_end_group`).  The parent ends its workers at exit
(a KeyboardInterrupt included) and on SIGTERM or SIGHUP (see :func:`install_signal_cleanup`), and
unlinks every shared block it made for them.  Here too: :class:`_Process`, the handle on one
started worker process.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from tyingspec._src.engine.isolation.blocks import _BLOCKS, _unlink

# ---- no process of a run outlives it -------------------------------------------------------

#: Every worker process this process started and has not reaped yet, by pid (which is also its
#: process group's id): what :func:`_end_all` kills.
_LIVE: dict[int, _Process] = {}


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
