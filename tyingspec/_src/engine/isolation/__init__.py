"""User code runs in a worker process: its crash, exit or hang ends a case, never the run.

A ``module:attr`` target is imported and called in one persistent worker process: a fresh
interpreter that runs :mod:`engine.worker`, with this process's ``sys.path`` (set before it
imports anything), working directory and ``sys.argv``, so nothing of tyingspec's own state leaks
into it and user modules import as they do here.  Unlike a ``spawn`` child it never imports this
process's ``__main__``: a user's script that runs a check needs no ``if __name__ ==
"__main__":`` guard (a spawned worker re-ran the script).  The parent sends the inputs of a
call and waits, with a timeout, for the validated result.  When the worker raises
``SystemExit``, calls ``os._exit``, dies of a signal or runs past the timeout, that call becomes
an :class:`~tyingspec.AdapterError` naming what happened, the worker is killed and a fresh one
is started for the next call: the remaining cases run.  Built-in targets are tyingspec's own
code and run in-process.

State an adapter keeps between calls (a stateful bug, or a cache) lives in the worker and
survives from one call to the next, as it would in the user's training loop, until the worker
has to be restarted.

The parts, each read on its own (bottom up: each imports only those above it):

- :mod:`.wire`: the wire format.  The parent never executes what the worker sends: each answer
  is one frame of plain data (a JSON tree, then the raw bytes of its arrays), decoded without
  calling anything the frame names; what the parent sends the worker is still pickled (the
  worker trusts its parent).
- :mod:`.blocks`: shared blocks.  Large arrays cross through shared memory, one copy each way;
  the worker hands the adapter views of the parent's input blocks uncopied and the parent
  checks them after the call; a large dE comes back in a block the parent takes over.
- :mod:`.sources`: the files the worker's code came from, with a digest of each: what a kept
  worker is keyed on (see :mod:`engine.warm`).
- :mod:`.processes`: no process of a run outlives it (process groups, a subreaper, the cleanup
  at exit and on signals).
- :mod:`.serving`: the worker's side: import the target, answer calls.
- :mod:`.launch`: starting a worker, and the one the command starts before numpy loads.
- :mod:`.handle`: :class:`Worker`, this process's handle on one worker.

numpy (and ``core.memory``, which needs it) load where they are used in every part: the
command starts its worker before this process loads numpy (see :func:`launch_early`).

This module re-exports the names the rest of tyingspec, the tests and the benchmarks use.  A
name set here (``monkeypatch.setattr(isolation, "RESULTS_KEPT", 0)``, a benchmark's timing
wrapper) is set in every part that holds it too, so it takes effect as it did when this was one
module.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from tyingspec._src.core.options import DEFAULT_TIMEOUT
from tyingspec._src.engine.isolation import (
    blocks,
    handle,
    launch,
    processes,
    serving,
    sources,
    wire,
)
from tyingspec._src.engine.isolation.blocks import _PWRITE_BYTES as _PWRITE_BYTES
from tyingspec._src.engine.isolation.blocks import RESULTS_KEPT as RESULTS_KEPT
from tyingspec._src.engine.isolation.blocks import SHARE_ABOVE as SHARE_ABOVE
from tyingspec._src.engine.isolation.blocks import _create as _create
from tyingspec._src.engine.isolation.blocks import _in_block as _in_block
from tyingspec._src.engine.isolation.blocks import _release as _release
from tyingspec._src.engine.isolation.blocks import _take as _take
from tyingspec._src.engine.isolation.blocks import _write_result as _write_result
from tyingspec._src.engine.isolation.blocks import _written_over as _written_over
from tyingspec._src.engine.isolation.handle import Worker
from tyingspec._src.engine.isolation.launch import _EARLY as _EARLY
from tyingspec._src.engine.isolation.launch import BOOTSTRAP as BOOTSTRAP
from tyingspec._src.engine.isolation.launch import launch_early
from tyingspec._src.engine.isolation.processes import _LIVE as _LIVE
from tyingspec._src.engine.isolation.processes import install_signal_cleanup
from tyingspec._src.engine.isolation.serving import _serve as _serve
from tyingspec._src.engine.isolation.sources import HASH_BELOW as HASH_BELOW
from tyingspec._src.engine.isolation.sources import _Sources as _Sources
from tyingspec._src.engine.isolation.sources import digest as digest
from tyingspec._src.engine.isolation.sources import unchanged as unchanged
from tyingspec._src.engine.isolation.wire import _HEAD as _HEAD
from tyingspec._src.engine.isolation.wire import _MAGIC as _MAGIC
from tyingspec._src.engine.isolation.wire import _decode as _decode
from tyingspec._src.engine.isolation.wire import _dtype_of as _dtype_of
from tyingspec._src.engine.isolation.wire import _encode as _encode
from tyingspec._src.engine.isolation.wire import _Refused as _Refused
from tyingspec._src.engine.isolation.wire import _Shared as _Shared
from tyingspec._src.engine.isolation.wire import _Unsendable as _Unsendable

__all__ = ["DEFAULT_TIMEOUT", "Worker", "install_signal_cleanup", "launch_early"]

#: The parts, in the order they import each other.
_PARTS: tuple[types.ModuleType, ...] = (wire, blocks, sources, processes, serving, launch, handle)


class _Package(types.ModuleType):
    """This package's module: a name set on it is set in each part that holds that name too
    (each part reads its own globals, as the one module did)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        for part in _PARTS:
            if name in vars(part):
                setattr(part, name, value)


sys.modules[__name__].__class__ = _Package
