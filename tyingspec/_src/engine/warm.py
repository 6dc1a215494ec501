"""Loaded targets kept for the next check in the same process (``tyingspec.check`` called from
a user's own tests, a notebook, a loop over configurations).

Starting a worker imports the user's module, and torch with it: seconds, paid once per process
instead of once per check.  A target is reused only while its source is unchanged: the files of
its top-level module (every ``.py`` of a package) are stamped by modification time when it is
loaded, and a later edit loads it afresh, so a notebook that fixes its kernel and checks again
never judges the old code.  The stamp is read without importing anything, so no user code runs
in this process.  A worker that crashed or timed out restarts itself on its next call
(:class:`engine.isolation.Worker`); every kept worker is stopped at exit.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path

from tyingspec._src.core.cases import Case
from tyingspec._src.engine.observe import PrecisionChoice, Target, load

Key = tuple[str, str, str, float, tuple[str, ...]]


def source_stamp(spec: str, paths: Sequence[str]) -> tuple[str, int] | None:
    """Where ``spec``'s top-level module lives and the newest modification time among its
    files; None when it cannot be found without importing (a built-in name, a namespace)."""
    if ":" not in spec:
        return None
    top = spec.partition(":")[0].split(".")[0]
    found = importlib.machinery.PathFinder.find_spec(top, [*paths, *sys.path])
    if found is None or not found.origin or found.origin in ("built-in", "frozen"):
        return None
    origin = Path(found.origin)
    files = list(origin.parent.rglob("*.py")) if found.submodule_search_locations else [origin]
    try:
        return str(origin), max((f.stat().st_mtime_ns for f in files), default=0)
    except OSError:
        return None


class WarmTargets:
    """Targets by (spec, kind, precision, timeout, paths), each with the stamp it was loaded at."""

    def __init__(self) -> None:
        self._kept: dict[Key, tuple[Target, tuple[str, int] | None]] = {}

    def get(self, spec: str, kind: str, precision: PrecisionChoice, *, timeout: float,
            paths: tuple[str, ...], prepare: Sequence[Case] = ()) -> Target:
        """The loaded target, or a fresh one (its load errors raise, as :func:`load`'s)."""
        key: Key = (spec, kind, precision, timeout, paths)
        stamp = source_stamp(spec, paths)
        kept = self._kept.get(key)
        if kept is not None:
            target, was = kept
            if stamp == was:
                return target
            del self._kept[key]
            target.close()  # its source changed: the next check runs the code as it is now
        target = load(spec, kind, precision, timeout=timeout, paths=paths, prepare=prepare)
        self._kept[key] = (target, stamp)
        return target

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Stop every kept worker."""
        kept, self._kept = self._kept, {}
        for target, _ in kept.values():
            target.close()


#: the process's own: ``tyingspec.check`` keeps its targets here
WARM = WarmTargets()
atexit.register(WARM.close)
