"""Four ``tyingspec.assert_correct`` calls in one user's test (issue 53: "61 CPU-s"): the
README's numpy adapter, the torch adapter of ``examples/torch_model``, the linear-ce kernel and
the nanogpt model, in one test function run by ``python -m pytest``, as a user's suite would.

Run from the repository root::

    python -m benchmarks.bench_assert_correct --rounds 3
    # beside the code of another tree (e.g. the last commit, exported without touching git):
    mkdir /tmp/head && git archive HEAD | tar -x -C /tmp/head \\
        && ln -s ../properties /tmp/head/tyingspec/properties
    python -m benchmarks.bench_assert_correct --rounds 3 --against /tmp/head

Variants, interleaved round by round, each a fresh ``python -m pytest`` on the generated test
file, run from the repository root so that ``examples.*`` imports:

- ``against`` (with ``--against DIR``): DIR's code first on ``PYTHONPATH``, its cache warm;
- ``warm``: this tree, the cache of the sympy reference's derived sources filled by an untimed
  run first (every run after a user's first);
- ``cold``: this tree, that cache empty each round (``TYINGSPEC_CACHE_DIR`` a fresh directory:
  a user's first run).

Prints each round, then the spread (min, median, max) of the CPU seconds (pytest and every
process it waited for: each target's worker) beside the wall seconds, and each variant's whole
command.

``--per-call`` runs the four calls once in one process instead and prints what each cost, in
this process and in the workers (a worker is kept for the next check of its target, so the
live workers' CPU is read before they stop).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.commands import Variant, interleaved_in, python  # noqa: E402

#: (target, kind) as the user's test names them.
CALLS = [("examples.numpy_model.grads:tied_backward", None),
         ("examples.torch_model.grads:tied_backward", None),
         ("examples.linear_ce.kernel:linear_ce", "linear-ce"),
         ("examples.torch_nanogpt.model:make_model", "torch")]

USER_TEST = "import tyingspec\n\n\ndef test_my_tied_gradients():\n" + "".join(
    f"    tyingspec.assert_correct({t!r}{'' if k is None else f', kind={k!r}'})\n"
    for t, k in CALLS)


def per_call() -> None:
    """Each call's CPU seconds: this process's own, and its workers' (live or waited for)."""
    import resource
    import time

    import psutil

    import tyingspec

    def cpu() -> tuple[float, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        done = resource.getrusage(resource.RUSAGE_CHILDREN)
        live = sum(sum(p.cpu_times()[:2]) for p in psutil.Process().children(recursive=True))
        return me.ru_utime + me.ru_stime, done.ru_utime + done.ru_stime + live

    before = cpu()
    for target, kind in CALLS:
        t0 = time.perf_counter()
        tyingspec.assert_correct(target, kind)
        after = cpu()
        print(f"{target} ({kind or 'model'}): {time.perf_counter() - t0:.2f} s wall, "
              f"{after[0] - before[0]:.2f} CPU-s here + {after[1] - before[1]:.2f} in workers",
              flush=True)
        before = after


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, help="another tree's code to time beside this one")
    p.add_argument("--per-call", action="store_true", help="each call's cost, in one process")
    args = p.parse_args(argv)
    if args.per_call:
        per_call()
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="tyingspec-bench-"))
    test = scratch / "test_user.py"
    test.write_text(USER_TEST)
    pytest = [python(), "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider"]
    warm, cold = scratch / "warm", scratch / "cold"

    def empty_cold() -> None:
        shutil.rmtree(cold, ignore_errors=True)

    variants = []
    if args.against is not None:
        there = {"PYTHONPATH": str(args.against.resolve()), "TYINGSPEC_CACHE_DIR": str(warm)}
        variants.append(Variant("against", pytest, REPO, there))
    here = {"PYTHONPATH": str(REPO)}
    variants += [Variant("warm", pytest, REPO, {**here, "TYINGSPEC_CACHE_DIR": str(warm)}),
                 Variant("cold", pytest, REPO, {**here, "TYINGSPEC_CACHE_DIR": str(cold)},
                         before=empty_cold)]
    print(f"the user's test ({test}):\n{USER_TEST}", flush=True)
    # untimed: the warm cache filled for each tree (a changed symbolic.py saves its own files)
    for v in variants:
        if v.name != "cold":
            Variant("fill", v.argv, v.cwd, v.env).run()
    return interleaved_in(scratch, variants, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
