"""`jax.test_util.check_grads` against `tyingspec check --kind jax` on the same model, side by
side in one run.

Run from the repository root::

    python -m benchmarks.bench_jax                      # V = 1024, 4096, 16384; 3 rounds
    python -m benchmarks.bench_jax --sizes 1024 --repeats 2 --seeds 3

The model is a pure ``loss_fn`` (``x = E[tokens]``, ``h = x + tanh(x @ W)``, ``logits = h @
E.T``, mean cross-entropy; d = 64, batch 2 x 32, float32), written to a scratch module per size
with a correct form and one whose ``custom_vjp`` lookup returns no gradient for the table (the
dropped input path).  Interleaved over ``--repeats`` rounds (A, B, C, A, B, C, ...):

- (A) one jitted forward+backward of the correct model: compile excluded (compiled by an
  untimed first call); the median of 20 calls is one sample;
- (B cold) ``check_grads(loss of E, (E,), order=1, modes=["rev"])`` on the correct model in a
  fresh process, as one test pays it: its compiles included (check_grads runs op by op, each
  operation compiled on first use), the interpreter start and the jax import excluded (timed
  from after the import);
- (B warm) the same call in this process after an untimed first call: compile excluded;
- (C) the whole command ``tyingspec check MODULE:target --kind jax`` as a subprocess: the
  interpreter start, the jax import, every compile, every check and every standard case
  included (what a user waits for).

Nothing is dropped: every sample of every round is in the min/median/max.  It prints those
for each and the medians of B and C divided by A's, then, over ``--seeds`` seeds (the
model's initialisation and batch drawn from the seed), how often each catches the dropped
input path: check_grads raising, ``tyingspec check --case repeated-tokens --seed s`` exiting 1
with ``input_path_missing``; and whether either names the rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

D, B, T = 64, 2, 32

MODULE = textwrap.dedent('''
    import os
    import jax
    import jax.numpy as jnp
    from tyingspec import JaxTarget

    V, D, B, T = {V}, {D}, {B}, {T}
    SEED = int(os.environ.get("BENCH_SEED", "0"))

    def init(seed=SEED):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        return {{"embed": 0.5 * jax.random.normal(k1, (V, D)),
                 "w": jax.random.normal(k2, (D, D)) / D ** 0.5}}

    def ce(logits, targets):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def loss_fn(p, tokens, targets, lookup=None):
        E = p["embed"]
        x = E[tokens] if lookup is None else lookup(E, tokens)
        return ce((x + jnp.tanh(x @ p["w"])) @ E.T, targets)

    @jax.custom_vjp
    def dropped_lookup(E, ids):
        return E[ids]

    def _fwd(E, ids):
        return E[ids], jnp.zeros_like(E)

    def _bwd(zeros, g):
        return zeros, None

    dropped_lookup.defvjp(_fwd, _bwd)

    def dropped_loss(p, tokens, targets):
        return loss_fn(p, tokens, targets, dropped_lookup)

    target = JaxTarget(loss_fn=loss_fn, params=init, table="embed", batch_size=B, seq_len=T)
    dropped = JaxTarget(loss_fn=dropped_loss, params=init, table="embed", batch_size=B,
                        seq_len=T)
''')


def _stats(xs: list[float]) -> str:
    return f"min {min(xs):.4g}  median {statistics.median(xs):.4g}  max {max(xs):.4g}"


def _batch(V: int, seed: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = rng.choice(V, size=B * T // 2, replace=False)
    tokens = rng.permutation(np.concatenate([pool, rng.choice(pool, size=B * T // 2)]))
    return tokens.reshape(B, T), rng.integers(V, size=(B, T))


def _fwd_bwd(mod: Any, V: int) -> float:
    import jax

    p = mod.init(0)
    t, y = _batch(V, 0)
    step = jax.jit(jax.value_and_grad(mod.loss_fn))
    jax.block_until_ready(step(p, t, y))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(step(p, t, y))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _check_grads(mod: Any, V: int, seed: int, loss: Any) -> bool:
    """True when check_grads passes."""
    from jax.test_util import check_grads

    p = mod.init(seed)
    t, y = _batch(V, seed)
    try:
        check_grads(lambda E: loss({**p, "embed": E}, t, y), (p["embed"],), order=1,
                    modes=["rev"], atol=1e-2, rtol=1e-2)
    except AssertionError:
        return False
    return True


_COLD = """
import sys, time
import jax
jax.config.update("jax_enable_x64", True)
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from benchmarks.bench_jax import _check_grads
import importlib
mod = importlib.import_module(sys.argv[3])
start = time.perf_counter()
assert _check_grads(mod, int(sys.argv[4]), 0, mod.loss_fn)
print(time.perf_counter() - start)
"""


def _check_grads_cold(name: str, where: str, V: int) -> float:
    """Seconds of one check_grads in a fresh process, from after its jax import."""
    run = subprocess.run([sys.executable, "-c", _COLD, where, str(REPO), name, str(V)],
                         capture_output=True, text=True, timeout=3600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return float(run.stdout.split()[-1])


def _tyingspec(module: str, attr: str, where: str, *extra: str, seed: int = 0
               ) -> tuple[float, int, str]:
    env = dict(os.environ, PYTHONPATH=f"{where}{os.pathsep}{REPO}", BENCH_SEED=str(seed))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "tyingspec", "check", f"{module}:{attr}",
                          "--kind", "jax", *extra], capture_output=True, text=True, env=env,
                         timeout=3600)
    return time.perf_counter() - start, run.returncode, run.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    import importlib

    import jax

    jax.config.update("jax_enable_x64", True)  # as the worker runs it
    tmp = tempfile.mkdtemp(prefix="bench_jax_")
    print(f"jax {jax.__version__}, d={D}, batch {B}x{T}, float32 model; rounds interleaved")
    for V in (int(v) for v in args.sizes.split(",")):
        name = f"bench_jax_model_{V}"
        Path(tmp, f"{name}.py").write_text(MODULE.format(V=V, D=D, B=B, T=T))
        sys.path.insert(0, tmp)
        mod = importlib.import_module(name)
        a, cold, warm, c = [], [], [], []
        assert _check_grads(mod, V, 0, mod.loss_fn), "check_grads failed a correct model"
        for _ in range(args.repeats):
            a.append(_fwd_bwd(mod, V))
            cold.append(_check_grads_cold(name, tmp, V))
            start = time.perf_counter()
            _check_grads(mod, V, 0, mod.loss_fn)
            warm.append(time.perf_counter() - start)
            took, code, out = _tyingspec(name, "target", tmp)
            assert code == 0, out[-2000:]
            c.append(took)
        fb = statistics.median(a)
        print(f"V={V} ({args.repeats} rounds):")
        for label, xs in (("(A) forward+backward, warm", a), ("(B) check_grads, cold", cold),
                          ("(B) check_grads, warm", warm), ("(C) tyingspec check (all)", c)):
            ratio = "" if xs is a else f"   {statistics.median(xs) / fb:.0f}x A"
            print(f"  {label:<28}{_stats(xs)} s{ratio}")
        caught_cg = sum(not _check_grads(mod, V, s, mod.dropped_loss) for s in range(args.seeds))
        caught_ts, named = 0, 0
        for s in range(args.seeds):
            _, code, out = _tyingspec(name, "dropped", tmp, "--case", "repeated-tokens",
                                      "--seed", str(s), seed=s)
            caught_ts += code == 1 and "input_path_missing" in out
            named += "rows" in out and "wrong" in out
        print(f"  dropped input path caught: check_grads {caught_cg}/{args.seeds} (no rows "
              f"named), tyingspec {caught_ts}/{args.seeds} (rows named in {named})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
