"""``tyingspec check --quick`` beside the full check, on a small torch model (issue 53): the
editor loop's check against the one CI runs.

Run from the repository root::

    python -m benchmarks.bench_quick_check --rounds 3            # the built-in nanogpt
    python -m benchmarks.bench_quick_check --target mypkg.model:target --rounds 3

Variants, interleaved round by round, each a fresh ``python -m tyingspec check TARGET --kind
torch --quiet`` (this tree first on ``PYTHONPATH``): ``quick`` with ``--quick``, ``full``
without.  Prints each round (its verdict line, which says ``quick: N of M cases``), then the
spread of the CPU seconds (the command and the worker it waited for) and the wall seconds, and
each variant's whole command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.commands import Variant, interleaved, python  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target", default="nanogpt")
    args = p.parse_args(argv)
    check = [python(), "-m", "tyingspec", "check", args.target, "--kind", "torch", "--quiet"]
    env = {"PYTHONPATH": str(REPO)}
    variants = [Variant("quick", [*check, "--quick"], REPO, env),
                Variant("full", check, REPO, env)]
    interleaved(variants, args.rounds)
    return max(v.last.returncode if v.last else 1 for v in variants)


if __name__ == "__main__":
    sys.exit(main())
