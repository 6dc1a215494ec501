"""What `tyingspec check --kind torch` costs against training the model it checks, and how many
forward evaluations the row localisation spends as the vocabulary grows.

Run from the repository root::

    python -m benchmarks.bench_torch_check              # --repeats 5
    python -m benchmarks.bench_torch_check --repeats 3 --skip-localisation

Part 1, interleaved over ``--repeats`` rounds (A, B, A, B, ...):

- (A) one training step of the tiny GPT-2 (the ``gpt2`` built-in: transformers'
  ``GPT2LMHeadModel``, V=61, d=16, 1 layer, batch 2 x 8): forward, backward and an AdamW step,
  in a fresh Python process that has already imported torch and transformers and built the
  model (the step alone is timed, after one warm-up step);
- (B) the whole command ``tyingspec check gpt2 --kind torch`` as a subprocess: start-up, the
  worker, every case and every check.

It prints min/median/max of each and median(B)/median(A).

Part 2: the ``nanogpt-embedding-no-accumulate`` model at V in (64, 512, 4096, 32768) (its bug:
repeated tokens lose occurrences in the lookup's backward, which a custom autograd.Function
hides from the hooks, so only the forward can find the rows), one case with 4 repeated tokens:
the forward evaluations the group testing spent and the rows it found, next to V*d (the
forward evaluations of a full finite-difference Jacobian).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.launch import tyingspec_cmd  # noqa: E402

STEP = """
import time, torch
torch.set_num_threads(1)
from tyingspec._src.kinds.torch.zoo import gpt2
torch.manual_seed(0)
m = gpt2()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
t = torch.randint(0, 61, (2, 8))
def step():
    opt.zero_grad()
    m(input_ids=t, labels=t).loss.backward()
    opt.step()
step()
s = time.perf_counter(); step(); print(time.perf_counter() - s)
"""


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    return time.perf_counter() - start, run


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"


def part_timing(repeats: int) -> None:
    steps: list[float] = []
    checks: list[float] = []
    for _ in range(repeats):
        run = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True,
                             cwd=REPO)
        steps.append(float(run.stdout.strip().splitlines()[-1]))
        seconds, check = timed([*tyingspec_cmd(), "check", "gpt2", "--kind", "torch"])
        if check.returncode != 0:
            raise SystemExit(f"tyingspec check gpt2 --kind torch exited {check.returncode}:\n"
                             + check.stdout[-2000:] + check.stderr[-2000:])
        checks.append(seconds)
    print(f"tiny GPT-2 (V=61, d=16, 1 layer, batch 2 x 8), {repeats} interleaved rounds")
    print(f"  (A) one training step (fwd + bwd + AdamW): {spread(steps)}")
    print(f"  (B) tyingspec check gpt2 --kind torch:     {spread(checks)}")
    print(f"  (B) / (A): {statistics.median(checks) / statistics.median(steps):.0f}x")


def part_localisation() -> None:
    import torch

    from tyingspec._src.core.cases import Case
    from tyingspec._src.engine.observe import load, observe
    from tyingspec._src.kinds.torch.zoo import _nano

    torch.set_num_threads(1)
    print("localisation: nanogpt-embedding-no-accumulate, one batch of 16 tokens with 4 "
          "repeated")
    print(f"  {'V':>6} {'d':>3} {'V*d':>9} {'forward evals':>14} {'rows found':>11} "
          f"{'repeated rows':>14} {'seconds':>8}")
    import tyingspec._src.kinds.torch.zoo as zoo

    for V in (64, 512, 4096, 32768):
        name = f"_bench_no_accumulate_{V}"
        setattr(zoo, name, lambda V=V: _nano("EmbeddingNoAccumulate", vocab_size=V))
        target = load(f"tyingspec._src.kinds.torch.zoo:{name}", "torch", isolate=False)
        case = Case(name="bench", V=V, d=16, N=16, seed=1, composition="repeats", distinct=4,
                    probe=False)
        start = time.perf_counter()
        o = observe(target, case)
        seconds = time.perf_counter() - start
        f = next(x for x in o.diagnosis.findings if x.check == "gradient against the forward")
        repeated = sorted({int(t) for t in o.case.tokens or ()})
        found = f.detail.split("]")[0].split("[")[-1] if f.failed else "none"
        found = found or "(budget reached)"
        print(f"  {V:>6} {16:>3} {V * 16:>9} {f.evaluations:>14} {found:>11} "
              f"{str(repeated):>14} {seconds:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-localisation", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_timing:
        part_timing(args.repeats)
    if not args.skip_localisation:
        part_localisation()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
