"""The ``tyingspec`` command's process, before numpy loads: how its BLAS threads wait.

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tyingspec`` console script and ``python -m tyingspec``."""
    load_numpy()
    from tyingspec._src.front.cli import main as cli_main

    return cli_main(argv)
