"""How the benchmarks run the ``tyingspec`` command: as a user of this interpreter does."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def tyingspec_cmd() -> list[str]:
    """The console script installed beside this interpreter (a venv's ``bin/``), else the one
    on ``PATH``, else ``python -m tyingspec``.  The one beside ``sys.executable`` comes first
    because the command is timed against processes of ``sys.executable`` itself (``bench_check``'s
    (F)): a launcher on ``PATH`` in front of the script (pyenv's shim, a bash script that runs
    two more: 0.13 s on the 2-core VM) would be charged to the check."""
    beside = Path(sys.executable).parent / "tyingspec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    exe = shutil.which("tyingspec")
    return [exe] if exe else [sys.executable, "-m", "tyingspec"]
