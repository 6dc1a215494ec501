"""How the benchmarks run the ``tyingspec`` command (as a user of this interpreter does), and
the arguments they share.  Nothing here loads numpy: ``bench_check_timeline`` starts the
command's worker before it does."""

from __future__ import annotations

import argparse
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


def shape_parser(doc: str | None, repeats: int | None = 3) -> argparse.ArgumentParser:
    """The arguments every GPT-2-size benchmark takes: the shape ``--V --d --N`` (GPT-2's by
    default) and, unless ``repeats`` is None, ``--repeats`` rounds (that many by default); the
    description is the first line of the benchmark's docstring ``doc``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    ap.add_argument("--V", type=int, default=50257)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--N", type=int, default=1024)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats)
    return ap
