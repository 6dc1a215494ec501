"""The ``tyingspec`` command's process, before numpy loads: its worker first, then how its BLAS
threads wait.

A check of a ``module:attr`` target spends its first seconds in the worker's import of the
target (torch and the user's module), and everything this process does before it starts that
worker (loading numpy and the modules of a check, parsing its arguments: 0.2 s on a 2-core VM)
comes on top.  So the command reads the target, kind and timeout from its arguments first
(:func:`early_target`, a guess that declines whatever it is unsure of) and starts the worker
before anything else; the check takes it over when it loads that same target, and a wrong guess
costs only the head start (see ``engine.isolation.launch_early``).  Once that worker runs, this
process lowers its own scheduling priority (``NICE``): what it does beside the worker (the
reference while the worker imports the target, the rest of it while the worker calls it) is
bookkeeping the worker's progress should not wait for, and on a busy core the worker now goes
first.  The worker keeps the user's priority; one restarted after a crash inherits this
process's.

OpenBLAS (numpy's BLAS) keeps its threads spinning for about 2**28 cycles (a tenth of a second)
after each product before they sleep, and reads how long from ``OPENBLAS_THREAD_TIMEOUT`` once,
as it loads.  A check alternates products with numpy work that uses one core, while the worker
running the target wants both; on a 2-core machine the spinning took 0.77 CPU seconds of a
6.3 CPU-second check at GPT-2 size (a ``perf`` profile: ``blas_thread_server``), time the worker
and this process's own single-threaded passes waited for.  The command's process is tyingspec's
own, so it sets the shortest wait before numpy loads and takes the variable out of the
environment again at once: the worker that runs the user's code, and any other process started
from here, get the user's environment as it was.  A user's own setting is kept, and nothing
changes in a process that loaded numpy first (the pytest plugin, the Python API).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

#: How far this process's niceness rises once its early worker runs (``os.nice``; it can only
#: rise).  On the 2-core VM of docs/speed.md, 10 interleaved pairs of the cold GPT-2-size check
#: each: +5, median of the differences -0.18 s (9 of 10 faster); +10, -0.18 s (10 of 10); +19,
#: -0.12 s (9 of 10).  The smallest that gains as much, so that on a machine shared with other
#: jobs the check gives up no more than it must.
NICE = 5
#: OpenBLAS's shortest wait (2**4 cycles); the names OpenBLAS reads, the first one wins there.
_WAIT = ("OPENBLAS_THREAD_TIMEOUT", "4")
_READ = ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")


def load_numpy() -> bool:
    """Load numpy with OpenBLAS's threads set to sleep at once, unless numpy is loaded already
    or the environment says otherwise; True when the setting was ours.  ``os.environ`` is as it
    was on return either way."""
    if "numpy" in sys.modules or any(name in os.environ for name in _READ):
        return False
    name, value = _WAIT
    os.environ[name] = value
    try:
        import numpy  # noqa: F401  (OpenBLAS reads its environment as it loads, and only then)
    finally:
        del os.environ[name]
    return True


def early_target(argv: Sequence[str]) -> tuple[str, str, float] | None:
    """The (spec, kind, timeout) of ``tyingspec check MODULE:ATTR ...``, read from ``argv``
    before its parser exists (it needs numpy): the target right after ``check``, the last
    ``--kind`` and ``--timeout`` as argparse takes them.  None for anything else, or anything
    this reading is unsure of; a wrong guess costs the head start, never the result, since
    the worker is taken over only by a launch for the same target (see
    ``engine.isolation.launch_early``)."""
    from tyingspec._src.core.options import DEFAULT_TIMEOUT, positive_seconds

    if len(argv) < 2 or argv[0] != "check" or argv[1].startswith("-") or ":" not in argv[1]:
        return None
    given = {"--kind": "model", "--timeout": str(DEFAULT_TIMEOUT)}
    rest = list(argv[2:])
    for i, arg in enumerate(rest):
        name, eq, value = arg.partition("=")
        if arg in ("-h", "--help", "--list", "--") or name == "--compile":
            # --compile takes a longer timeout than the one read here
            return None
        if name in given:
            if not eq:
                if i + 1 >= len(rest):
                    return None
                value = rest[i + 1]
            given[name] = value
    try:
        timeout = positive_seconds(given["--timeout"])
    except Exception:  # noqa: BLE001  (argparse says what is wrong with it, later)
        return None
    return argv[1], given["--kind"], timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tyingspec`` console script and ``python -m tyingspec``: a check of
    a ``module:attr`` target starts its worker first and gives way to it (``NICE``), then this
    process loads numpy."""
    args = sys.argv[1:] if argv is None else list(argv)
    early = early_target(args) if "numpy" not in sys.modules else None
    if early is not None:
        from tyingspec._src.core.options import target_paths
        from tyingspec._src.engine.isolation import launch_early

        spec, kind, timeout = early
        launch_early(spec, kind, target_paths(), timeout)  # what front.cli will load
        try:
            os.nice(NICE)
        except (AttributeError, OSError):  # no nice here: the check runs as it did
            pass
    load_numpy()
    from tyingspec._src.front.cli import main as cli_main

    return cli_main(argv)
