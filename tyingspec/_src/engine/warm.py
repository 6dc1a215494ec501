"""Loaded targets kept for the next check in the same process (``tyingspec.check`` called from
a user's own tests, a notebook, a loop over configurations).

Starting a worker imports the user's module, and torch with it: seconds, paid once per process
instead of once per check.  A target is reused only while what its code came from is what is on
disk now: the worker records every module it imported from outside the installed environment
(the user's own, a sibling helper included) and every file its code opened there to read (a
config read at import), each with a digest of its bytes as it was read
(:class:`engine.isolation._Sources`), and a check reuses the worker only when every one of them
still holds those bytes.  Content, not modification times: a helper edited under a kept mtime, a
module replaced by a copy that keeps an old one (``cp -p``, ``rsync -t``) and a changed config
all load afresh, so a notebook that fixes its kernel and checks again never judges the old code.
The digests are read in this process without importing anything, so no user code runs here.
A worker that died or timed out is loaded afresh too.

A check ends what it started: a kept worker whose target left a process of its own running (a
child it forked, one that left the worker's process group) is stopped with it at the end of the
check (:meth:`WarmTargets.settle`), and the next check loads afresh.  Every kept worker is
stopped at exit.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence

from tyingspec._src.core.cases import Case
from tyingspec._src.core.kind import KindSpec
from tyingspec._src.engine.observe import PrecisionChoice, Target, load

Key = tuple[str, str, str, float, tuple[str, ...]]


class WarmTargets:
    """Targets by (spec, kind, precision, timeout, paths), each kept while its code is current."""

    def __init__(self) -> None:
        self._kept: dict[Key, Target] = {}

    def get(self, spec: str, kind: KindSpec, precision: PrecisionChoice, *, timeout: float,
            paths: tuple[str, ...], prepare: Sequence[Case] = ()) -> Target:
        """The loaded target, or a fresh one (its load errors raise, as :func:`load`'s)."""
        key: Key = (spec, kind.name, precision, timeout, paths)
        target = self._kept.pop(key, None)
        if target is not None:
            # a built-in runs in this process: tyingspec's own code, nothing to go stale
            if target.worker is None or target.worker.current():
                self._kept[key] = target
                return target
            target.close()  # what it came from changed: the next check runs the code as it is
        target = load(spec, kind, precision, timeout=timeout, paths=paths, prepare=prepare)
        self._kept[key] = target
        return target

    def settle(self, target: Target) -> None:
        """At the end of a check of ``target``: stop its worker, and forget it, when a process
        its code started still runs (the worker's own end kills them all)."""
        if target.worker is not None and target.worker.strays():
            for key in [k for k, kept in self._kept.items() if kept is target]:
                del self._kept[key]
            target.close()

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Stop every kept worker."""
        kept, self._kept = self._kept, {}
        for target in kept.values():
            target.close()


#: the process's own: ``tyingspec.check`` keeps its targets here
WARM = WarmTargets()
atexit.register(WARM.close)
