"""The pytest plugin's quick start as the README gives it (issue 53): the 9 model properties at
the ``dev`` profile's 30 examples on ``examples/numpy_model``'s adapter, ``-n auto``.

Run from the repository root::

    python -m benchmarks.bench_plugin_quickstart --rounds 3
    # beside the code of another tree (e.g. the last commit, exported without touching git):
    mkdir /tmp/head && git archive HEAD | tar -x -C /tmp/head \\
        && ln -s ../properties /tmp/head/tyingspec/properties
    python -m benchmarks.bench_plugin_quickstart --rounds 3 --against /tmp/head

Variants, interleaved round by round, each a fresh ``python -m pytest`` with its tree first on
``PYTHONPATH`` (``CI`` unset, so the ``dev`` profile):

- ``against`` (with ``--against DIR``): DIR's code, run in DIR;
- ``cold``: this tree with an empty cache of the sympy reference's derived sources
  (``TYINGSPEC_CACHE_DIR`` a fresh directory each round): a user's first run;
- ``warm``: this tree with that cache filled by an untimed run first: every later run (the
  examples are Hypothesis' random draws, so a run can still meet a shape not yet saved);
- ``serial``: ``warm`` without ``-n auto``: one process runs the 9 properties, where xdist
  starts two more interpreters (each pays pytest's, the plugins' and tyingspec's imports,
  ~1.5 CPU-s on the machine this was written on) and an adapter worker for each.

Prints each round, then the spread of the CPU seconds (this command and every process it
waited for: the xdist workers and their adapter workers) and the wall seconds, and each
variant's whole command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.commands import Variant, interleaved_in, python  # noqa: E402

#: The README's command (``pytest`` there: ``python -m pytest`` here, so the interpreter is
#: this one), without pytest's cache so that no run leaves state for the next.
QUICKSTART = ["-m", "pytest", "examples/numpy_model",
              "--tyingspec-adapter=examples.numpy_model.grads:tied_backward", "-n", "auto",
              "-p", "no:cacheprovider"]
SERIAL = [a for a in QUICKSTART if a not in ("-n", "auto")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, help="another tree's code to time beside this one")
    args = p.parse_args(argv)
    os.environ.pop("CI", None)  # the dev profile, as on a user's machine
    scratch = Path(tempfile.mkdtemp(prefix="tyingspec-bench-"))
    warm_cache, cold_cache = scratch / "warm", scratch / "cold"

    def empty_cold() -> None:
        shutil.rmtree(cold_cache, ignore_errors=True)

    variants = []
    if args.against is not None:
        there = args.against.resolve()
        variants.append(Variant("against", [python(), *QUICKSTART], there,
                                {"PYTHONPATH": str(there), "PYTHONDONTWRITEBYTECODE": "1"}))
    here = {"PYTHONPATH": str(REPO)}
    variants += [
        Variant("cold", [python(), *QUICKSTART], REPO,
                {**here, "TYINGSPEC_CACHE_DIR": str(cold_cache)}, before=empty_cold),
        Variant("warm", [python(), *QUICKSTART], REPO,
                {**here, "TYINGSPEC_CACHE_DIR": str(warm_cache)}),
        Variant("serial", [python(), *SERIAL], REPO,
                {**here, "TYINGSPEC_CACHE_DIR": str(warm_cache)})]
    Variant("fill", [python(), *QUICKSTART], REPO,
            {**here, "TYINGSPEC_CACHE_DIR": str(warm_cache)}).run()  # untimed
    return interleaved_in(scratch, variants, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
