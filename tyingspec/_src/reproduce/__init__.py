"""``tyingspec reproduce``: re-derive the weight-tying write-up's claims on tyingspec's engine.

Each experiment prints its setup, then a table of quantity | claim | measured | verdict, and with
``--out DIR`` writes ``DIR/NAME.json`` (same content plus raw series) and ``DIR/NAME.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tyingspec._src.reproduce import (
    _alignment,
    _blind_spot,
    _gradient_table,
    _init_coupling,
    _loss_curves,
    _param_savings,
    _repeat_bias,
)
from tyingspec._src.reproduce._common import (
    FAILS,
    HOLDS,
    ProgressFactory,
    Result,
    pyplot,
    render,
    silent_progress,
    single_threaded_blas,
    stderr_progress,
    write_json,
)

__all__ = ["configure_parser", "run"]


@dataclass(frozen=True)
class Experiment:
    name: str
    module: ModuleType
    default_seeds: tuple[int, ...]

    @property
    def title(self) -> str:
        return str(self.module.TITLE)


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment(_gradient_table.NAME, _gradient_table, (0,)),
    Experiment(_blind_spot.NAME, _blind_spot, (0,)),
    Experiment(_loss_curves.NAME, _loss_curves, (0, 1, 2)),
    Experiment(_repeat_bias.NAME, _repeat_bias, (0, 1, 2, 3, 4)),
    Experiment(_alignment.NAME, _alignment, (0, 1, 2, 3, 4)),
    Experiment(_init_coupling.NAME, _init_coupling, (0, 1, 2, 3, 4)),
    Experiment(_param_savings.NAME, _param_savings, ()),
)}


def _seeds(text: str) -> tuple[int, ...]:
    """``N`` means seeds 0..N-1; a comma-separated list (``3,7`` or ``11,``) means those seeds."""
    try:
        if "," in text:
            seeds = tuple(int(s) for s in text.split(",") if s.strip())
        else:
            n = int(text)
            if n < 1:
                raise ValueError
            seeds = tuple(range(n))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds expects a count N >= 1 (seeds 0..N-1) or a comma-separated list of "
            f"non-negative seeds, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"--seeds: no usable seeds in {text!r}")
    return seeds


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add NAME / --all / --seeds / --out / --quick / --no-progress to ``p``."""
    listing = "; ".join(f"{e.name}: {e.title}" for e in EXPERIMENTS.values())
    p.description = ("Reproduce the weight-tying write-up's experiments on tyingspec's own "
                     "numpy engine: each prints its setup and a table of claim, measured figure "
                     "and verdict.")
    p.add_argument("name", nargs="?", choices=list(EXPERIMENTS), metavar="NAME",
                   help=f"experiment to run, one of: {listing}")
    p.add_argument("--all", action="store_true", help="run every experiment in order")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="N",
                   help="number of seeds (0..N-1) or a list like 3,7; default per experiment "
                        "(5 for repeat-bias, aligned-vs-misaligned and init-coupling)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write DIR/NAME.json and, with matplotlib installed, DIR/NAME.png")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (fewer steps, trials, grid points) for a smoke run; the "
                        "figures are then not comparable with the claims")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_experiment(name: str, *, seeds: Sequence[int] | None = None, quick: bool = False,
                   progress: ProgressFactory = silent_progress,
                   out: Path | None = None, written: list[Path] | None = None) -> Result:
    """Run one experiment and, given ``out``, write its JSON (and PNG when it can)."""
    exp = EXPERIMENTS[name]
    chosen = tuple(seeds) if seeds else exp.default_seeds
    with single_threaded_blas():
        result: Result = exp.module.run(chosen, quick=quick, progress=progress)
    if out is not None:
        plt = pyplot()  # None (after one notice) without matplotlib: the JSON still goes out
        png = exp.module.plot(result, out / f"{name}.png", plt) if plt is not None else None
        paths = [write_json(result, out), png]
        if written is not None:
            written.extend(p for p in paths if p is not None)
    return result


def unusable_out(out: Path) -> str | None:
    """Why ``--out DIR`` cannot take the files, found before any experiment runs (an hour of
    work is not lost to a typo): a part of the path is a file, or DIR cannot be made or
    written.  A DIR that does not exist yet is made now (with its parents), as it would be
    at the end."""
    full = Path(os.path.abspath(out))
    existing = full
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return (f"--out {str(out)!r}: {str(existing)!r} is a file, not a directory"
                if existing == full else
                f"--out {str(out)!r}: {str(existing)!r} is a file, so no directory can be made "
                "under it")
    try:
        full.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=full):  # permissions, a read-only mount, /proc
            pass
    except OSError as exc:
        return (f"--out {str(out)!r}: the directory cannot be made or written "
                f"({exc.strerror or exc})")
    return None


def run(args: argparse.Namespace) -> int:
    """Run what ``args`` asks for; 0 when it ran (whatever the verdicts), 2 on usage errors."""
    if bool(args.name) == bool(args.all):
        sys.stderr.write("tyingspec reproduce: give one experiment NAME or --all (not both); "
                         f"experiments: {', '.join(EXPERIMENTS)}\n")
        return 2
    if args.out is not None:
        problem = unusable_out(args.out)
        if problem is not None:
            sys.stderr.write(f"tyingspec reproduce: {problem}\n")
            return 2
    names = list(EXPERIMENTS) if args.all else [args.name]
    progress = silent_progress if args.no_progress else stderr_progress
    t0 = time.perf_counter()
    summary: list[tuple[str, int, int, float]] = []
    written: list[Path] = []
    for i, name in enumerate(names):
        if i:
            print()
        result = run_experiment(name, seeds=args.seeds, quick=args.quick, progress=progress,
                                out=args.out, written=written)
        print(render(result), flush=True)
        tally = result.as_dict()["verdicts"]
        summary.append((name, tally[HOLDS], tally[FAILS], result.elapsed_s))
    if args.out is not None:
        print(f"\nwrote to {args.out}: {', '.join(p.name for p in written)}")
    if len(names) > 1:
        print("\nsummary: experiment | holds | does not hold | seconds")
        for name, ok, bad, sec in summary:
            print(f"  {name:<22} {ok:>5} {bad:>13} {sec:>9.1f}")
        print(f"  total {time.perf_counter() - t0:.1f} s")
    if args.quick:
        print("\n(--quick: tiny sizes; figures are smoke-test values, not comparable with the "
              "claims)")
    return 0
