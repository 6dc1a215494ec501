"""The files a worker's code came from, each with a digest: what a kept worker is keyed on.

Each answer of the worker names the files its code read since the last answer (an audit hook
sees each ``open``; the modules imported are read too), with a :func:`digest` of each.  The
parent keeps the worker for the next ``tyingspec.check`` only while every one of them still
holds that (:func:`unchanged`; see :mod:`engine.warm`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import threading
from collections.abc import Mapping
from typing import Any

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

    # tyingspec's own package: this file is tyingspec/_src/engine/isolation/sources.py
    here = os.path.abspath(__file__)
    for _ in range(4):
        here = os.path.dirname(here)
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
