"""Every file tyingspec writes (JSON report, baseline, summary): atomic, distinct, where the
user said.

Paths are resolved once, at start (so an adapter's ``os.chdir`` cannot move them); a symlink is
followed and its target replaced, never the link; an existing file keeps its mode; a write goes
to a temporary file beside the target and is renamed over it, so an interrupted or failed write
(a full disk) leaves the previous file whole; a device or FIFO (``--json /dev/null``) is
written into, never replaced.  Standard library only: the pytest plugin imports
this in its controller.
"""

from __future__ import annotations

import os
import stat
import tempfile

__all__ = ["OutputError", "absolute", "append_text", "atomic_write", "check_distinct",
           "create_exclusive", "is_stream", "usable_output"]


class OutputError(Exception):
    """An output path cannot be used; the message names the option and the path."""


def absolute(path: str) -> str:
    """The path as an absolute one, symlinks followed (what is actually written)."""
    return os.path.realpath(os.path.abspath(path))


def usable_output(option: str, path: str) -> str:
    """Check an output path before the run: not empty, not a directory, its directory exists.
    Returns the absolute path; raises :class:`OutputError`."""
    if not path:
        raise OutputError(f"{option}: expected a file path, got an empty string")
    full = absolute(path)
    if os.path.isdir(full):
        raise OutputError(f"{option}: expected a file path, got the directory {path!r}")
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


def is_stream(path: str) -> bool:
    """An existing path that is no regular file (``/dev/null``, ``/dev/stdout``, a pipe, a
    device): written in place as a stream, since a temporary file renamed over it would replace
    the device node with a regular file, for every program on the machine.  Asked of the path
    as given: ``/dev/stdout`` resolves to ``/proc/PID/fd/pipe:[N]``."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def atomic_write(path: str, text: str) -> None:
    """Replace the file at ``path`` (a symlink's target) with ``text`` atomically; a device or a
    FIFO there is written into instead."""
    if is_stream(path):
        with open(path, "w", encoding="utf-8") as fh:
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
    """Append ``text`` (a summary file collects every step's summary) in one write."""
    with open(absolute(path), "a", encoding="utf-8") as fh:
        fh.write(text)
