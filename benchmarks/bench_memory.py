"""Peak memory of `tyingspec check` against the implementation's own forward+backward (issue 23 §3).

Run from the repository root::

    python -m benchmarks.bench_memory                          # V=128256 d=4096 N=1024 (Llama-3)
    python -m benchmarks.bench_memory --V 32768 --d 2048 --N 1024 --repeats 3
    python -m benchmarks.bench_memory --case repeated-tokens     # one case per check (ce-plain
                                                                  # for linear-ce)

For the ``kernel`` kind (built-in ``tied``) and the ``linear-ce`` kind (built-in ``ce-torch``),
each in float32 and bfloat16, interleaved over ``--repeats`` rounds, each measurement a fresh
subprocess whose peak resident set size is read from ``wait4`` (what ``/usr/bin/time -v`` calls
"Maximum resident set size"; a built-in target runs in the checking process, so that is the
whole peak):

- (own) the implementation's own forward+backward at the shape, nothing judged: for ``kernel``
  the probe model's forward over E producing (tokens, dx, h, g) and the ``tied`` kernel's dE,
  E kept (a model's parameter lives through its backward); for ``linear-ce`` one construct,
  forward and backward of ``ce-torch`` on the case's inputs as torch tensors sharing numpy's
  memory (``weight.grad`` is the dE); on every case the whole check runs at the shape, one
  after another in one process, so that its peak is the largest of theirs (on ``--case``
  alone when given; before 2026-12-06 on one case, ``repeated-tokens`` or ``ce-plain``,
  whatever the check ran);
- (check) ``tyingspec check SPEC --kind KIND --shape V,d,N --precision P --shrink-budget 0``
  (``--case`` when given).

It prints, per kind and precision, min/median/max of both peaks and both wall times, and the
ratio of the median peaks (issue 23's target: at most 1.5).  ``--kinds`` picks the kinds; a
configuration the check refuses for memory prints the refusal instead of its figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.launch import tyingspec_cmd  # noqa: E402

BUILTIN = {"kernel": "tied", "linear-ce": "ce-torch"}
#: The case the (own) run builds its inputs from: one the check runs at every shape.
OWN_CASE = {"kernel": "repeated-tokens", "linear-ce": "ce-plain"}


def own_cases(kind: str, V: int, d: int, N: int, case_name: str | None) -> list[str]:
    """The cases (own) runs: ``case_name``, or every case the whole check runs at this shape
    (its peak is the most any of them takes: a batch of 1024 distinct tokens takes more than
    one of a few repeated ones, 1.07 GiB against 0.83 for the ``tied`` kernel at V=32768,
    d=2048, so one case would flatter the whole check's ratio)."""
    if case_name is not None:
        return [case_name]
    from tyingspec._src.core.cases import at_shape
    from tyingspec._src.kinds.table import kind_spec

    fitted, _ = at_shape(kind_spec(kind).cases(0), V, d, N, kind_spec(kind))
    return [c.name for c in fitted]


def own(kind: str, precision: str, V: int, d: int, N: int, case_name: str) -> None:
    """The implementation's own forward+backward on one case, in this process (the ``--own``
    mode runs it for each of :func:`own_cases` in turn: the process's peak is the largest)."""
    from dataclasses import replace

    from tyingspec._src.core.cases import at_shape, build
    from tyingspec._src.kinds.table import kind_spec

    spec = kind_spec(kind)
    case = next(c for c in spec.cases(0) if c.name == case_name)
    (case,), _ = at_shape([case], V, d, N, spec)
    batch = build(replace(case, dtype=precision), spec)
    if kind == "kernel":
        from tyingspec._src.core.paths import forward_parts
        from tyingspec._src.kinds.probe.builtins import builtins

        p = forward_parts(batch.E, batch.E, batch.W, batch.b, batch.tokens, batch.targets,
                          batch.res, batch.s_in)
        kernel = builtins()["tied"].kernel
        assert kernel is not None
        dE = kernel(batch.tokens, p.input_rows, p.h, p.g, V)
        assert dE.shape == (V, d)
        return
    import numpy as np
    import torch

    from tyingspec._src.kinds.linear_ce.kind import inputs, kernel_keywords
    from tyingspec._src.kinds.linear_ce.zoo import ce_torch

    def tensor(a: np.ndarray) -> torch.Tensor:
        if a.dtype.name == "bfloat16":  # torch reads ml_dtypes' bfloat16 through its bits
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    inp = inputs(batch)
    weight = tensor(inp["E"]).requires_grad_()
    h = tensor(np.ascontiguousarray(inp["h"])).requires_grad_()
    bias = None if inp["b"] is None else tensor(inp["b"]).requires_grad_()
    options = kernel_keywords(batch)
    if options.get("ce_weight") is not None:  # the class form takes a tensor, as Liger's does
        options["ce_weight"] = tensor(np.asarray(options["ce_weight"]))
    loss = ce_torch(**options)(weight, h, torch.from_numpy(inp["targets"]), bias)
    if loss.ndim:  # reduction "none": the case's upstream gradient, as the check hands it
        go = batch.grad_output
        loss.backward(torch.ones_like(loss) if go is None else tensor(np.asarray(go)))
    else:
        loss.backward()
    assert weight.grad is not None and tuple(weight.grad.shape) == (V, d)


def one_case(kind: str, name: str) -> str:
    """``--case`` for ``kind``: the name given where the kind has such a case, else the kind's
    own (the linear-ce cases are named ce-*)."""
    from tyingspec._src.kinds.table import kind_spec

    return name if any(c.name == name for c in kind_spec(kind).cases(0)) else OWN_CASE[kind]


def measure(cmd: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS in bytes, exit status and the last line of output of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    lines = [x for x in out.strip().splitlines() if x.strip()]
    return wall, usage.ru_maxrss * 1024.0, proc.returncode, lines[-1] if lines else ""


def spread(xs: list[float], unit: str, scale: float = 1.0) -> str:
    v = [x / scale for x in xs]
    return f"{statistics.median(v):.2f} {unit} (min {min(v):.2f}, max {max(v):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--V", type=int, default=128256)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--N", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kinds", default="kernel,linear-ce")
    parser.add_argument("--precisions", default="float32,bfloat16")
    parser.add_argument("--case", default=None, help="one case per check (default: all)")
    parser.add_argument("--own", nargs=2, metavar=("KIND", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.own:
        kind, precision = args.own
        for name in own_cases(kind, args.V, args.d, args.N, args.case):
            own(kind, precision, args.V, args.d, args.N, name)
        return 0
    shape = f"{args.V},{args.d},{args.N}"
    configs = [(k, p) for k in args.kinds.split(",") for p in args.precisions.split(",")]
    figures: dict[tuple[str, str], dict[str, list[float]]] = {
        c: {"own_rss": [], "own_wall": [], "check_rss": [], "check_wall": []} for c in configs}
    refused: dict[tuple[str, str], str] = {}
    print(f"bench_memory: V={args.V} d={args.d} N={args.N}, case "
          f"{args.case or 'all (the whole check)'}, {args.repeats} interleaved round(s)",
          flush=True)
    for _ in range(args.repeats):
        for kind, precision in configs:
            if (kind, precision) in refused:
                continue
            check = tyingspec_cmd() + ["check", BUILTIN[kind], "--kind", kind, "--shape", shape,
                                       "--precision", precision, "--shrink-budget", "0"] + \
                (["--case", one_case(kind, args.case)] if args.case else [])
            wall, rss, code, last = measure(check)
            if code == 2:
                refused[(kind, precision)] = last
                continue
            f = figures[(kind, precision)]
            f["check_wall"].append(wall)
            f["check_rss"].append(rss)
            print(f"  check {kind} {precision}: {wall:.1f} s, {rss / 2**30:.2f} GiB ({last})",
                  flush=True)
            wall, rss, code, last = measure(
                [sys.executable, "-m", "benchmarks.bench_memory", "--own", kind, precision,
                 "--V", str(args.V), "--d", str(args.d), "--N", str(args.N)]
                + (["--case", one_case(kind, args.case)] if args.case else []))
            if code != 0:
                raise SystemExit(f"own forward+backward of {kind} {precision} failed: {last}")
            f["own_wall"].append(wall)
            f["own_rss"].append(rss)
            print(f"  own   {kind} {precision}: {wall:.1f} s, {rss / 2**30:.2f} GiB", flush=True)
    print()
    print(f"{'kind':10s} {'precision':9s}  {'own fwd+bwd peak':30s}  {'check peak':30s}  "
          f"{'ratio':5s}  {'own wall':26s}  check wall")
    for kind, precision in configs:
        if (kind, precision) in refused:
            print(f"{kind:10s} {precision:9s}  refused: {refused[(kind, precision)]}")
            continue
        f = figures[(kind, precision)]
        ratio = statistics.median(f["check_rss"]) / statistics.median(f["own_rss"])
        print(f"{kind:10s} {precision:9s}  {spread(f['own_rss'], 'GiB', 2**30):30s}  "
              f"{spread(f['check_rss'], 'GiB', 2**30):30s}  {ratio:5.2f}  "
              f"{spread(f['own_wall'], 's'):26s}  {spread(f['check_wall'], 's')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
