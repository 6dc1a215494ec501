"""The whole `tyingspec check --kind jax` of a tiny NNX model beside a fresh-process
`jax.test_util.check_grads` of the same loss: what a user waits for, each side whole.

Run from the repository root::

    python -m benchmarks.bench_jax_whole                 # 3 interleaved rounds
    python -m benchmarks.bench_jax_whole --rounds 2

The model is ``examples/jax/nnx_model.py`` (``nnx.Embed(37, 8)`` read by ``__call__`` and
``.attend``, one ``nnx.Linear``, float32).  Each round runs, one after the other (A, B, A, B,
...), both as subprocesses from a fresh interpreter, so the interpreter start, the imports and
every compile are in both:

- (A) ``tyingspec check examples.jax.nnx_model:make_model --kind jax``: every check, every
  standard case;
- (B) ``python -c`` that builds the same model, splits it with ``nnx.split``, and runs
  ``check_grads`` of the mean cross-entropy of its logits as a function of the table,
  ``order=1, modes=["rev"]``, on a 2 x 8 batch (what one test of the model's gradient with
  JAX's own tool costs).

For each it prints the wall seconds and the CPU seconds (user + system of the child, from
``resource.getrusage(RUSAGE_CHILDREN)``) of every round, their min/median/max (nothing is
dropped), and the ratio of A's medians to B's.  The machine's other load shows as the spread
between rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHECK_GRADS = """
import jax, jax.numpy as jnp
from flax import nnx
from jax.test_util import check_grads
from examples.jax.nnx_model import make_model
graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)
t = jnp.asarray([[3, 5, 3, 0, 7, 3, 5, 9], [1, 3, 2, 2, 8, 0, 4, 5]])
y = jnp.roll(t, -1, axis=-1)
def table(path):
    return jax.tree_util.keystr(path) == jax.tree_util.keystr(where)
where = next(p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
             if "embedding" in jax.tree_util.keystr(p))
def loss(E):
    p = jax.tree_util.tree_map_with_path(lambda path, x: E if table(path) else x, params)
    logits = nnx.merge(graphdef, p, rest)(t)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))
E0 = next(x for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if table(p))
check_grads(loss, (E0,), order=1, modes=["rev"],
            atol=1e-2, rtol=1e-2)
"""


def _timed(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one subprocess, which must exit 0."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=3600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert run.returncode == 0, (cmd, run.stdout[-2000:], run.stderr[-2000:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _stats(xs: list[float]) -> str:
    return f"min {min(xs):7.2f}  median {statistics.median(xs):7.2f}  max {max(xs):7.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sides = {
        "(A) tyingspec check --kind jax": [sys.executable, "-m", "tyingspec", "check",
                                           "examples.jax.nnx_model:make_model", "--kind",
                                           "jax"],
        "(B) check_grads, fresh process": [sys.executable, "-c", _CHECK_GRADS],
    }
    got: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in sides}
    print(f"tiny NNX model (V=37, d=8, float32), {args.rounds} interleaved rounds, "
          f"{os.cpu_count()} cores")
    for r in range(args.rounds):
        for name, cmd in sides.items():
            wall, cpu = _timed(cmd)
            got[name]["wall"].append(wall)
            got[name]["cpu"].append(cpu)
            print(f"  round {r + 1}: {name:<32} wall {wall:7.2f} s   CPU {cpu:7.2f} s",
                  flush=True)
    for name in sides:
        print(f"{name:<32} wall {_stats(got[name]['wall'])} s")
        print(f"{'':<32} CPU  {_stats(got[name]['cpu'])} s")
    a, b = got["(A) tyingspec check --kind jax"], got["(B) check_grads, fresh process"]
    wall = statistics.median(a["wall"]) / statistics.median(b["wall"])
    cpu = statistics.median(a["cpu"]) / statistics.median(b["cpu"])
    print(f"A / B (medians): wall {wall:.2f}x, CPU {cpu:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
