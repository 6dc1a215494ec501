"""The default test tier's size and cost, as CONTRIBUTING.md quotes them: the number of tests
and the CPU seconds of ``pytest -n 2 -q`` (every xdist worker included, from
``getrusage(RUSAGE_CHILDREN)``), with the wall seconds beside them.

Run from the repository root (about ten minutes on a loaded two-core machine)::

    python -m benchmarks.bench_suite                 # the default tier
    python -m benchmarks.bench_suite -- -m slow      # any other pytest arguments after --

One run: a suite this long is measured once, and its CPU seconds, unlike its wall seconds,
hold on a machine shared with other work.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.commands import Variant, python  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    suite = Variant("suite", [python(), "-m", "pytest", "-n", "2", "-q", "-p",
                              "no:cacheprovider", *extra], REPO, {"PYTHONPATH": str(REPO)})
    suite.run()
    assert suite.last is not None
    out = suite.last.stdout
    summary = (re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", out, re.M) or ["?"])[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|"
                                                r"deselected|xfailed|xpassed)", summary)}
    ran = sum(v for k, v in counts.items() if k != "deselected")
    print(f"command: {suite.command()}")
    print(f"summary: {summary}")
    print(f"tests: {ran} ({', '.join(f'{v} {k}' for k, v in counts.items())})")
    print(f"CPU seconds: {suite.cpu[0]:.0f} (this pytest and its xdist workers); "
          f"wall seconds: {suite.wall[0]:.0f}; exit {suite.last.returncode}")
    if suite.last.returncode not in (0,):
        print(out[-3000:], file=sys.stderr)
    return suite.last.returncode


if __name__ == "__main__":
    sys.exit(main())
