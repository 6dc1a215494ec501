"""Every file tyingspec writes (JSON report, baseline, summary): atomic, distinct, where the
user said.

Paths are resolved once, at start (so an adapter's ``os.chdir`` cannot move them); a symlink is
followed and its target replaced, never the link; an existing file keeps its mode; a write goes
to a temporary file beside the target and is renamed over it, so an interrupted or failed write
(a full disk) leaves the previous file whole; a device or FIFO (``--json /dev/null``) is
written into, never replaced.  A name of one of this process's open descriptors
(``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``, or the very file its
stdout is) is written through that descriptor, after what is already printed: ``--json
/dev/stdout > log`` leaves the report and the JSON in ``log``, where reopening the path would
truncate ``log`` and renaming over it would replace it.  Standard library only: the pytest
plugin imports this in its controller.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from typing import IO, Any

from tyingspec._src.core.errors import TyingspecError

__all__ = ["OutputError", "absolute", "append_text", "atomic_write", "check_distinct",
           "create_exclusive", "descriptor", "is_stream", "open_stream", "usable_output"]


class OutputError(TyingspecError):
    """An output path cannot be used; the message names the option and the path."""


def absolute(path: str) -> str:
    """The path as an absolute one, symlinks followed (what is actually written)."""
    return os.path.realpath(os.path.abspath(path))


def usable_output(option: str, path: str) -> str:
    """Check an output path before the run: not empty, not a directory, its directory exists.
    Returns the absolute path (a stream's as given, links not followed: ``/dev/stdout`` names
    this process's stdout only by that name); raises :class:`OutputError`."""
    if not path:
        raise OutputError(f"{option}: expected a file path, got an empty string")
    full = absolute(path)
    if os.path.isdir(full):
        raise OutputError(f"{option}: expected a file path, got the directory {path!r}")
    if is_stream(path):
        return os.path.abspath(path)
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise OutputError(f"{option}: the directory {os.path.dirname(path) or '.'!r} of "
                          f"{path!r} does not exist")
    return full


def check_distinct(named: dict[str, str | None]) -> None:
    """Refuse two options that name the same file (one would destroy the other)."""
    seen: dict[str, str] = {}
    for option, path in named.items():
        if not path:
            continue
        full = absolute(path)
        if full in seen:
            raise OutputError(f"{seen[full]} and {option} name the same file {path!r}; one "
                              "would overwrite the other: give them different files")
        seen[full] = option


def _mode_for(target: str) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_temp(target: str, text: str) -> str:
    directory = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(target))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


#: a path that names an open descriptor of a process (Linux's /proc, and /dev/fd)
_FD_PATH = re.compile(r"/(?:dev/fd|proc/(self|thread-self|\d+)/fd)/(\d+)")


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def descriptor(path: str) -> int | None:
    """The open descriptor of this process that ``path`` names, if any: ``/dev/stdout``,
    ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N`` (followed link by link, as given: the
    last link resolves to the file behind the descriptor, ``log`` or ``pipe:[N]``), or the file
    this process's stdout or stderr is.  Such a path is written through the descriptor: opened
    anew, a regular file behind it (the shell's ``> log``) would be truncated and written from
    its start, over what was printed there."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        found = _FD_PATH.fullmatch(p)
        if found is not None:
            pid = found.group(1)
            if pid is None or pid in ("self", "thread-self") or int(pid) == os.getpid():
                fd = int(found.group(2))
                try:
                    os.fstat(fd)
                except OSError:
                    return None
                return fd
            break  # another process's descriptor: the file behind it, as any path
        try:
            link = os.readlink(p)
        except OSError:
            break
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    try:
        st = os.stat(path)
    except OSError:
        return None
    for fd in (1, 2):
        try:
            if _same(os.fstat(fd), st):
                return fd
        except OSError:
            continue
    return None


def is_stream(path: str) -> bool:
    """An existing path that is no regular file (``/dev/null``, ``/dev/stdout``, a pipe, a
    device), or one of this process's open descriptors (:func:`descriptor`): written in place as
    a stream, since a temporary file renamed over it would replace the device node with a
    regular file, for every program on the machine (or, for ``--json /dev/stdout > log``,
    replace ``log`` and what was printed in it).  Asked of the path as given: ``/dev/stdout``
    resolves to ``/proc/PID/fd/pipe:[N]``."""
    if descriptor(path) is not None:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_stream(path: str, binary: bool = False) -> IO[Any]:
    """``path`` opened to write as a stream: one of this process's descriptors through a
    duplicate of it (closing it leaves stdout open), what is already printed flushed first so
    the two arrive in order; any other stream opened by its name."""
    mode = "wb" if binary else "w"
    fd = descriptor(path)
    if fd is None:
        return open(path, mode, encoding=None if binary else "utf-8")
    for printed in (sys.stdout, sys.stderr):
        try:
            printed.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing to keep
            pass
    return os.fdopen(os.dup(fd), mode, encoding=None if binary else "utf-8")


def atomic_write(path: str, text: str) -> None:
    """Replace the file at ``path`` (a symlink's target) with ``text`` atomically; a device, a
    FIFO or a descriptor of this process there is written into instead."""
    if is_stream(path):
        with open_stream(path) as fh:
            fh.write(text)
        return
    target = absolute(path)
    tmp = _write_temp(target, text)
    try:
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def create_exclusive(path: str, text: str) -> bool:
    """Write ``text`` to ``path`` only if no file is there yet (atomically); False when another
    process created it first."""
    target = absolute(path)
    tmp = _write_temp(target, text)
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def append_text(path: str, text: str) -> None:
    """Append ``text`` (a summary file collects every step's summary) in one write; through
    the descriptor when ``path`` names one of this process's (:func:`descriptor`), where a
    second opening in append mode would write at the file's end while stdout's own offset
    stays behind it, so that the next thing printed overwrites it."""
    if descriptor(path) is not None:
        with open_stream(path) as fh:
            fh.write(text)
        return
    with open(absolute(path), "a", encoding="utf-8") as fh:
        fh.write(text)
