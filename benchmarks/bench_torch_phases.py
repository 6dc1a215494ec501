"""Where `tyingspec check --kind torch` spends its time, over ten transformers architectures
(issue 23 §5).

Run from the repository root::

    python -m benchmarks.bench_torch_phases               # --repeats 3, the ten below
    python -m benchmarks.bench_torch_phases --repeats 1 --arch gpt2 llama

For each architecture (a tiny config from ``zoos/transformers_zoo.py``: V=97, d=32, 2 layers,
nothing downloaded), interleaved over ``--repeats`` rounds:

- (T) the whole command ``tyingspec check zoos.transformers_zoo:<factory> --kind torch`` as a
  subprocess: start-up, the worker, every case and every check;
- in one fresh subprocess per round, the same cases run in-process (``isolate=False``) with
  each phase of the torch kind's call timed: the imports (torch, transformers, the zoo), the
  first construction of the model (which pays transformers' lazy import of the model's own
  code, as any script building it does), the checks' other constructions (each check
  rebuilds the model from its factory; their time is also inside the check that asked), tie
  discovery, the observed pass (the gradient by path, which every check needs), and each check
  the call adds on top of it (identity, optimizer, forward, fresh, micro-batches, training
  steps).

It prints the medians per architecture and the share of (T) that the checks beyond the
observed pass take: the part of the total the check itself adds (issue 23: at most half).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.launch import tyingspec_cmd  # noqa: E402

ARCHS = {"gpt2": "gpt2", "gpt-neo": "gpt_neo", "bloom": "bloom", "falcon": "falcon",
         "opt": "opt", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
         "gemma": "gemma", "phi3": "phi3"}
#: the torch kind's phases, as functions of kinds/torch/adapter.py (what each check runs)
PHASES = {"tie discovery": "describe", "identity+optimizer": "_structural",
          "observed pass": "_observe_paths", "forward": "_against_forward", "fresh": "_fresh",
          "micro-batches": "_micro_batches", "training steps": "_training_steps"}
#: the phases a check adds beyond what observing the gradient needs
ADDED = ("identity+optimizer", "forward", "fresh", "micro-batches", "training steps")


def phases(factory: str) -> dict[str, float]:
    """Run in a fresh process: every case of ``tyingspec check`` in-process, phases timed."""
    t0 = time.perf_counter()
    import zoos.transformers_zoo  # noqa: F401  (torch and transformers with it)
    from tyingspec._src.kinds.torch import adapter
    imports = time.perf_counter() - t0
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - s
        return wrapper

    for name, attr in PHASES.items():
        setattr(adapter, attr, timed(name, getattr(adapter, attr)))
    # a model's construction: the first pays transformers' lazy import of the model's own
    # code (what any script that builds the model pays), the others are the checks' rebuilds
    spent["first build"] = spent["other builds"] = 0.0
    fresh = adapter.Build.fresh

    def fresh_timed(self, *a, **k):  # type: ignore[no-untyped-def]
        s = time.perf_counter()
        try:
            return fresh(self, *a, **k)
        finally:
            first = spent["first build"] == 0.0
            spent["first build" if first else "other builds"] += time.perf_counter() - s

    adapter.Build.fresh = fresh_timed  # type: ignore[method-assign]
    from tyingspec._src.engine.observe import load, observe, shaped
    from tyingspec._src.kinds.table import kind_spec

    t1 = time.perf_counter()
    target = load(f"zoos.transformers_zoo:{factory}", "torch", isolate=False)
    cases, _ = shaped(target, kind_spec("torch").cases(0))
    for case in cases:
        observe(target, case)
    total = time.perf_counter() - t1
    return {"imports": imports, **spent, "in-process total": total}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arch", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    a = ap.parse_args(argv)
    whole: dict[str, list[float]] = {k: [] for k in a.arch}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in a.arch}
    for _ in range(a.repeats):
        for arch in a.arch:
            factory = ARCHS[arch]
            t0 = time.perf_counter()
            run = subprocess.run(tyingspec_cmd() + ["check", f"zoos.transformers_zoo:{factory}",
                                           "--kind", "torch"], cwd=REPO, capture_output=True,
                                 text=True)
            whole[arch].append(time.perf_counter() - t0)
            if run.returncode != 0:
                print(f"{arch}: exit {run.returncode}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
                return 1
            code = (f"import json; from benchmarks.bench_torch_phases import phases; "
                    f"print(json.dumps(phases({factory!r})))")
            out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout
            parts[arch].append(json.loads(out.strip().splitlines()[-1]))
    cols = ["imports", "first build", "other builds", *PHASES, "in-process total"]
    print(f"== tyingspec check --kind torch, medians over {a.repeats} interleaved rounds "
          "(seconds)")
    print(f"{'arch':<9} {'(T) whole':>9} " + " ".join(f"{c[:13]:>13}" for c in cols)
          + f" {'added/(T)':>9}")
    shares = []
    for arch in a.arch:
        med = {c: statistics.median(p[c] for p in parts[arch]) for c in cols}
        T = statistics.median(whole[arch])
        added = sum(med[c] for c in ADDED)
        shares.append(added / T)
        print(f"{arch:<9} {T:9.2f} " + " ".join(f"{med[c]:13.2f}" for c in cols)
              + f" {added / T:9.0%}")
        print(f"{'':<9} (T) min {min(whole[arch]):.2f} max {max(whole[arch]):.2f}")
    print(f"what the checks beyond the observed pass add, as a share of the whole command: "
          f"min {min(shares):.0%}, median {statistics.median(shares):.0%}, "
          f"max {max(shares):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
