"""What `tyingspec check` costs a user with a torch model, and what it says about torch bugs.

Run from the repository root (the targets are ``benchmarks.torch_probe:NAME``)::

    python -m benchmarks.bench_check                          # V=50257 d=768 N=1024 (GPT-2)
    python -m benchmarks.bench_check --V 2000 --d 64 --N 256  # quick
    python benchmarks/bench_check.py --repeats 5 --skip-verdicts

Part 1 (timing), interleaved over ``--repeats`` rounds (a, b, F, c, S, I, the floor's parts,
a, b, ...):

- (a) one forward+backward of ``tied_f32``, called in this process on the float32 batch the
  check's ``absent-tokens`` case builds at that shape (after one untimed warm-up call);
- (b) the whole command ``tyingspec check benchmarks.torch_probe:tied_f32 --precision float32
  --shape V,d,N --case absent-tokens --shrink-budget 0 --json TMP``, as a subprocess;
- (c) the same command for the broken ``input_path_dropped``;
- (S) ``tyingspec --help`` as a subprocess: the Python + tyingspec start-up a command pays;
- (I) ``python -c "import benchmarks.torch_probe"`` as a subprocess: what any process that runs
  the target pays before its first call (the interpreter and the target's own import of torch);
- (F) the floor of any check that runs the target in a fresh process: a subprocess that imports
  the target, builds the check's batch with ``tyingspec.build`` and calls ``tied_f32`` once on
  it (no reference, no judgement, no second call).

It prints min/median/max of each, median(b)/median(a), median(b) - median(S),
median(b) - median(I): what the check costs beyond starting a process that imports the target,
median(F)/median(a): what a check would cost if its reference, judgement and second call
were free, and (median(I) + median(a))/median(a): the same for a check that builds its batch
while the target is imported, as tyingspec's does.  Then (b - F)/a round by round: (a), (b)
and (F) run back to back in each round, so the machine's drift between rounds (a tenth or more
within a minute on a shared VM) cancels in each round's ratio.  Last, the CPU seconds (user +
system, of every process and thread) of (a), (b) and (F), and the least (b - F)/a that (b)'s CPU
seconds allow however its parts were ordered on the machine's cores (CPU(b) / cores - F) / a:
where that alone is above a target, only less work can meet it.

Part 2 (verdicts): each broken torch variant, the correct one and the float64-returning one,
checked at the same shape on the case that exposes its bug; prints the JSON's verdict, label,
precision and margin next to the label expected.

Cost: at V=2000 d=64 N=256 the whole run takes about 35 s.  At the default (GPT-2) size one
check subprocess takes 5-7 s on a 2-core machine, and the whole run with ``--repeats 5`` took
164 s.  Use ``--skip-verdicts`` or ``--skip-timing`` to run one part.
"""

from __future__ import annotations

import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/bench_check.py` as well as `python -m`
    sys.path.insert(0, str(REPO))

from benchmarks.launch import shape_parser, tyingspec_cmd  # noqa: E402
from benchmarks.torch_probe import ADAPTERS, tied_f32  # noqa: E402
from tyingspec import build, standard_cases  # noqa: E402
from tyingspec._src.core import paths, threads  # noqa: E402
from tyingspec._src.core.cases import Batch, at_shape  # noqa: E402
from tyingspec._src.reproduce._common import single_threaded_blas  # noqa: E402

MODULE = "benchmarks.torch_probe"
BROKEN_TIMED = "input_path_dropped"


def check_argv(target: str, shape: tuple[int, int, int], case: str, precision: str,
               json_path: Path) -> list[str]:
    V, d, N = shape
    return ["check", f"{MODULE}:{target}", "--precision", precision, "--shape", f"{V},{d},{N}",
            "--case", case, "--shrink-budget", "0", "--json", str(json_path)]


@dataclass
class Run:
    """One subprocess: its command line, wall time, exit status and JSON report."""

    argv: list[str]
    seconds: float
    returncode: int
    report: dict[str, Any] | None
    stderr: str


def run_cli(args: Sequence[str], json_path: Path | None = None) -> Run:
    """Run ``tyingspec ARGS`` from the repository root and time the whole process."""
    argv = tyingspec_cmd() + list(args)
    if json_path is not None:
        json_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    report = (json.loads(json_path.read_text())
              if json_path is not None and json_path.exists() else None)
    return Run(argv, seconds, proc.returncode, report, proc.stderr)


def ran(run: Run, code: int) -> Run:
    """``run``, if it exited ``code``; a timing of a command that failed to run (an exit 2, a
    target not found) is no figure of the check, so the benchmark stops and shows why."""
    if run.returncode != code:
        raise SystemExit(f"expected exit {code} from {' '.join(run.argv)}, got "
                         f"{run.returncode}:\n{run.stderr.strip()[-2000:]}")
    return run


def absent_tokens_batch(shape: tuple[int, int, int], seed: int) -> Batch:
    """The float32 batch ``--precision float32 --shape V,d,N --case absent-tokens`` builds."""
    cases, _ = at_shape(standard_cases(seed), *shape)
    case = next(c for c in cases if c.name == "absent-tokens")
    return build(replace(case, dtype="float32"))


def forward_backward(batch: Batch) -> Callable[[], object]:
    return lambda: tied_f32(batch.E, batch.W, batch.b, batch.tokens, batch.targets,
                            res=batch.res, s_in=batch.s_in)


def floor_parts(batch: Batch) -> dict[str, Callable[[], object]]:
    """What a check of ``batch`` cannot skip beyond its first call, each timed on its own:

    - (R) the reference's two products of V*d*N multiply-adds, ``logits = h @ E.T`` and
      ``dh = g @ E``, as ``core.paths.forward_parts`` computes them for this batch: through
      E's integer factors in float64 where the case draws E through them (a part of rank
      ``core.cases.E_RANK`` plus one entry a row: GPT-2 size and up), else as numpy float32
      matmuls.  A reference that trusts nothing
      the target returns must form the logits to know ``g`` and ``dh`` to know ``dx``, the
      input path; ``dx`` is not linear in ``g @ E`` through a sketch, since
      ``du = dh * (1 - tanh(u)**2)`` weights each entry;
    - (2) the check's second call: ``tied_f32`` at E after the check's SGD step, on the first
      ``SECOND_CALL_POSITIONS`` positions (what catches a tie that is a copy; its O(V*d) work,
      converting E and scoring every row, is the implementation's own);
    - (D) drawing the batch (``tyingspec.build``: V*d uniform draws for E at this size), which
      (F) includes and the in-process (a) does not;
    - (R1) the products of (R) on one core (OpenBLAS on one thread): what the core that the
      worker's import leaves free can do of them (see :func:`print_floor`)."""
    import numpy as np

    from tyingspec._src.core.cases import sgd_step
    from tyingspec._src.engine.observe import SECOND_CALL_POSITIONS

    rng = np.random.default_rng(0)
    E = np.asarray(batch.E, np.float32)
    h = rng.standard_normal((batch.tokens.shape[0], E.shape[1]), dtype=np.float32)
    dE = forward_backward(batch)()["dE"]  # type: ignore[index]
    moved = sgd_step(batch, np.asarray(dE))
    assert moved is not None
    stepped = moved[0]
    keep = min(SECOND_CALL_POSITIONS, stepped.tokens.shape[0])
    short = replace(stepped, tokens=stepped.tokens[:keep], targets=stepped.targets[:keep])
    shape = (E.shape[0], E.shape[1], batch.tokens.shape[0])

    factors = batch.e_factors()

    def products() -> object:
        return paths._times_rows(paths._times_rows_T(h, E, factors), E, factors)

    def products_one_core() -> object:
        with single_threaded_blas():
            return products()

    return {"R": products, "2": forward_backward(short),
            "D": lambda: absent_tokens_batch(shape, 0), "R1": products_one_core}


def floor_call(shape: tuple[int, int, int]) -> None:
    """(F), run in a fresh process: draw the check's batch and call the target once."""
    fb = forward_backward(absent_tokens_batch(shape, 0))  # the check's own seed
    fb()


def floor_argv(shape: tuple[int, int, int]) -> list[str]:
    return [sys.executable, "-c",
            f"from benchmarks.bench_check import floor_call; floor_call({tuple(shape)!r})"]


def timed(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def timed_process(argv: list[str]) -> float:
    """Wall time of a subprocess run from the repository root (which must succeed)."""
    return timed(lambda: subprocess.run(argv, cwd=REPO, check=True))


@dataclass(frozen=True)
class Use:
    """CPU seconds (user + system, every thread), of them the system's, and minor page faults:
    on a VM a fresh page costs a fault and a zeroing in the kernel, so where a part's arrays
    come from shows in the last two."""

    cpu: float
    system: float
    faults: float

    def __sub__(self, other: Use) -> Use:
        return Use(self.cpu - other.cpu, self.system - other.system, self.faults - other.faults)

    def __add__(self, other: Use) -> Use:
        return Use(self.cpu + other.cpu, self.system + other.system, self.faults + other.faults)


def usage(who: int = resource.RUSAGE_SELF) -> Use:
    """This process's use so far, or (``RUSAGE_CHILDREN``) that of every process it has
    started and waited for, and theirs in turn: a check's worker is reaped by the check, so it
    counts in the check's."""
    r = resource.getrusage(who)
    return Use(r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt)


def children_cpu() -> float:
    """CPU seconds (user + system) of every process this one has started and waited for."""
    return usage(resource.RUSAGE_CHILDREN).cpu


def live_children_cpu() -> float:
    """CPU seconds (user + system) of this process's children still running, read from
    ``/proc`` (Linux): a warm check's worker, which no ``getrusage`` counts until it is reaped."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def with_cpu(run: Callable[[], float], cpu: Callable[[], float], into: list[float]
             ) -> float:
    """``run()``'s own figure, and the CPU seconds ``cpu`` counts across it appended to
    ``into``."""
    c0 = cpu()
    out = run()
    into.append(cpu() - c0)
    return out


def spread(xs: Sequence[float]) -> str:
    return (f"min {min(xs):8.3f} s  median {statistics.median(xs):8.3f} s  "
            f"max {max(xs):8.3f} s")


def case_summary(run: Run) -> str:
    """verdict, label, precision, margin and wrong rows of a one-case report."""
    rep = run.report
    if rep is None:
        return f"no JSON (exit {run.returncode}): {run.stderr.strip()[-300:]}"
    c = rep["cases"][0]
    margin = c.get("margin")
    m = "n/a" if margin is None else f"{float(margin):.3g}"
    return (f"verdict {rep['verdict']}, label {c.get('label')}, precision {c.get('precision')}, "
            f"margin {m}, rows wrong {c.get('rows_wrong')}/{c.get('rows_total')} "
            f"(exit {run.returncode}, {run.seconds:.1f} s)")


def timing(shape: tuple[int, int, int], repeats: int, seed: int, tmp: Path) -> None:
    V, d, N = shape
    batch = absent_tokens_batch(shape, seed)
    fb = forward_backward(batch)
    fb()  # warm-up: torch's first call pays one-off allocator and kernel set-up
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    s: list[float] = []
    imp: list[float] = []
    fl: list[float] = []
    parts = floor_parts(batch)
    part: dict[str, list[float]] = {k: [] for k in parts}
    last: dict[str, Run] = {}
    cpu: dict[str, list[float]] = {"a": [], "b": [], "F": []}

    def checked(name: str) -> float:
        """The whole command on ``name``; its run kept for the summary."""
        last[name] = ran(run_cli(check_argv(name, shape, "absent-tokens", "float32",
                                            tmp / "t.json"), tmp / "t.json"),
                         0 if name == "tied_f32" else 1)
        return last[name].seconds

    for _ in range(repeats):
        # (a), (b) and (F) back to back: this VM's speed drifts by a tenth or more within a
        # minute, so the round's own (b) - (F) over its own (a) is the figure it can vouch for
        a.append(with_cpu(lambda: timed(fb), time.process_time, cpu["a"]))
        b.append(with_cpu(lambda: checked("tied_f32"), children_cpu, cpu["b"]))
        fl.append(with_cpu(lambda: timed_process(floor_argv(shape)), children_cpu, cpu["F"]))
        c.append(checked(BROKEN_TIMED))
        s.append(ran(run_cli(["--help"]), 0).seconds)
        imp.append(timed_process([sys.executable, "-c", f"import {MODULE}"]))
        for k, f in parts.items():
            part[k].append(timed(f))
    print(f"== timing: V={V} d={d} N={N}, float32, seed {seed}, {repeats} interleaved rounds, "
          f"torch {torch_version()} with {torch_threads()} threads")
    print("(a) one forward+backward of tied_f32, in process")
    print(f"    {spread(a)}")
    print("(b) " + " ".join(["tyingspec"] + last["tied_f32"].argv[1:]).replace(
        str(tmp / "t.json"), "TMP"))
    print(f"    {spread(b)}   -> {case_summary(last['tied_f32'])}")
    print(f"(c) the same for {BROKEN_TIMED}")
    print(f"    {spread(c)}   -> {case_summary(last[BROKEN_TIMED])}")
    print("(S) tyingspec --help (interpreter + tyingspec start-up)")
    print(f"    {spread(s)}")
    print(f"(I) python -c 'import {MODULE}' (interpreter + the target's own imports)")
    print(f"    {spread(imp)}")
    print("(F) a fresh process: import the target, build the check's batch, one call")
    print(f"    {spread(fl)}")
    mb, ma, ms = statistics.median(b), statistics.median(a), statistics.median(s)
    mi, mf = statistics.median(imp), statistics.median(fl)
    print(f"median(b) / median(a)             = {mb / ma:.2f}x")
    print(f"median(b) - median(S)             = {mb - ms:.2f} s  "
          f"({(mb - ms) / ma:.2f}x one forward+backward)")
    print(f"median(b) - median(I)             = {mb - mi:.2f} s  "
          f"({(mb - mi) / ma:.2f}x one forward+backward)")
    print(f"median(c) / median(a)             = {statistics.median(c) / ma:.2f}x")
    print(f"median(F) / median(a)             = {mf / ma:.2f}x  (the floor: what any check "
          "that runs the target in a fresh process pays before judging anything)")
    print(f"(median(I) + median(a)) / median(a) = {(mi + ma) / ma:.2f}x  (the floor of a check "
          "that builds the batch while the target is imported: the import and one call)")
    print(f"median(b) - median(F)             = {mb - mf:.2f} s  "
          f"({(mb - mf) / ma:.2f}x one forward+backward: the reference, judgement and "
          "second call)")
    print_floor(part, ma, {"(b) - (F), what the check adds": mb - mf}, imported=mi)
    print(paired("(b) - (F) over (a), round by round (a, b and F run back to back)",
                 [(bi - fi) / ai for ai, bi, fi in zip(a, b, fl)]))
    print_work(a, b, fl, cpu)


def print_work(a: Sequence[float], b: Sequence[float], fl: Sequence[float],
               cpu: dict[str, list[float]]) -> None:
    """The CPU seconds (user + system, every process and thread) of (a), (b) and (F), and what
    (b)'s alone allow: on ``cores`` cores the whole check takes at least its CPU seconds over
    ``cores`` however its parts are ordered, so ``(CPU(b) / cores - F) / a`` is the least
    (b) - (F) over (a) that this much work permits (against (F)'s own time, which leaves cores
    idle while the target is imported)."""
    cores = threads.cores()  # what the check itself spreads its passes over
    print(f"CPU seconds, user + system: (a) {spread(cpu['a'])}")
    print(f"                            (b) {spread(cpu['b'])}")
    print(f"                            (F) {spread(cpu['F'])}")
    extra = statistics.median(cpu["b"]) - statistics.median(cpu["F"])
    busy = statistics.median(cb / (cores * tb) for cb, tb in zip(cpu["b"], b))
    print(f"(b) - (F) in CPU seconds: {extra:.2f} (medians); (b) kept {busy:.0%} of {cores} "
          "cores busy")
    print(paired(f"the least (b) - (F) over (a) that (b)'s CPU seconds allow on {cores} cores, "
                 "round by round", [(cb / cores - fi) / ai
                                    for ai, cb, fi in zip(a, cpu["b"], fl)]))


def paired(what: str, ratios: Sequence[float]) -> str:
    """``ratios``, one per round, each of figures timed back to back in that round: the
    machine's drift between rounds cancels in them, as it does not in a ratio of medians."""
    return (f"{what}: min {min(ratios):.2f}x  median {statistics.median(ratios):.2f}x  "
            f"max {max(ratios):.2f}x  ({', '.join(f'{r:.2f}' for r in ratios)})")


def print_floor(part: dict[str, list[float]], ma: float, against: dict[str, float],
                imported: float | None = None) -> None:
    """The parts of :func:`floor_parts`, their sum as a multiple of one forward+backward
    (``ma``), and each figure of ``against`` beside that floor.

    With ``imported`` (the median of (I): a fresh process importing the target), also the
    floor of a check that overlaps its reference with the worker's import as well as any
    could.  The import runs on one core (its user time is its wall time), so the other core
    is free while it lasts: it draws the batch first (2 (D) on one core) and has
    ``(I) - 2 (D)`` left for (R), which takes (R1) on one core.  The part of (R) that fits
    there is hidden; the rest, and the second call, are not."""
    names = {"R": "the reference's two V*d*N products, as the check computes them",
             "2": "the second call (after the SGD step, first positions)",
             "D": "drawing the batch (tyingspec.build)",
             "R1": "the reference's two products on one core"}
    for k, xs in part.items():
        print(f"({k}) {names[k]}\n    {spread(xs)}  ({statistics.median(xs) / ma:.2f}x)")
    med = {k: statistics.median(xs) for k, xs in part.items()}
    added = med["R"] + med["2"]
    print(f"floor of what a check adds beyond its first call, (R) + (2) = {added:.2f} s "
          f"({added / ma:.2f}x one forward+backward; (D) is in (F) already)")
    floors = {"(R) + (2)": added}
    if imported is not None:
        window = max(0.0, imported - 2 * med["D"])
        hidden = med["R"] * min(1.0, window / med["R1"])
        floors["the overlapped floor"] = added - hidden
        print(f"of (R), at most {hidden:.2f} s fits beside the worker's import: one core is "
              f"free for (I) - 2 (D) = {window:.2f} s, and (R) takes {med['R1']:.2f} s on one "
              f"core; so even overlapped as well as it can be, (R) + (2) - {hidden:.2f} = "
              f"{added - hidden:.2f} s ({(added - hidden) / ma:.2f}x), before any judging")
    for what, x in against.items():
        beside = ", ".join(f"{x - f:+.2f} s beside {name}" for name, f in floors.items())
        print(f"{what}: {x:.2f} s ({x / ma:.2f}x), {beside}")


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


#: The issue's duplicates claim: one token repeated twice in an otherwise distinct batch.
TWICE = "absent-tokens+one-token-twice"


def twice_args(shape: tuple[int, int, int]) -> list[str]:
    """``--case absent-tokens --tokens ... --targets ...`` with position 1 repeating position 0:
    exactly one token seen twice, every other token once."""
    from dataclasses import replace

    from tyingspec._src.core.cases import at_shape, build, standard_cases

    V, d, N = shape
    base = [c for c in standard_cases(0) if c.name == "absent-tokens"]
    case = replace(at_shape(base, V, d, N)[0][0], dtype="float32")
    batch = build(case)
    tokens = batch.tokens.copy()
    tokens[1] = tokens[0]
    return ["--case", "absent-tokens", "--tokens", ",".join(map(str, tokens)),
            "--targets", ",".join(map(str, batch.targets))]


#: (target, precision, case, label expected in the JSON)
VERDICT_RUNS: list[tuple[str, str, str, str]] = [
    ("tied_f32", "float32", TWICE, "correct"),
    ("one_token_twice_not_accumulated", "float32", TWICE,
     ADAPTERS["one_token_twice_not_accumulated"]),
    ("tied_f32", "float32", "repeated-tokens", "correct"),
    ("input_path_dropped", "float32", "repeated-tokens", ADAPTERS["input_path_dropped"]),
    ("one_token_twice_not_accumulated", "float32", "repeated-tokens",
     ADAPTERS["one_token_twice_not_accumulated"]),
    ("path_halved", "float32", "repeated-tokens", ADAPTERS["path_halved"]),
    ("tied_f32", "float32", "one-token-repeated", "correct"),
    ("one_token_twice_not_accumulated", "float32", "one-token-repeated",
     ADAPTERS["one_token_twice_not_accumulated"]),
    ("tied_f32", "float32", "token-zero", "correct"),
    ("padding_row_masked", "float32", "token-zero", ADAPTERS["padding_row_masked"]),
    ("tied_f32_upcast", "auto", "repeated-tokens", ADAPTERS["tied_f32_upcast"]),
    ("tied_f32_upcast", "float64", "repeated-tokens", "precision_limited"),
    ("tied_f32_upcast", "float32", "repeated-tokens", "correct"),
]


def verdicts(shape: tuple[int, int, int], tmp: Path) -> None:
    V, d, N = shape
    print(f"\n== verdicts at V={V} d={d} N={N} (--shrink-budget 0)")
    as_expected = 0
    for target, precision, case, expected in VERDICT_RUNS:
        argv = check_argv(target, shape, case.split("+")[0], precision, tmp / "v.json")
        if case == TWICE:
            i = argv.index("--case")
            argv[i:i + 2] = twice_args(shape)
        r = run_cli(argv, tmp / "v.json")
        got = None if r.report is None else r.report["cases"][0].get("label")
        ok = got == expected
        as_expected += ok
        print(f"{target:<32} --precision {precision:<7} --case {case:<18} expected {expected}")
        print(f"    {'OK  ' if ok else 'DIFF'} {case_summary(r)}")
        if not ok and r.report is not None:
            print(f"    detail: {r.report['cases'][0].get('detail')}")
    print(f"labels as expected: {as_expected} of {len(VERDICT_RUNS)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = shape_parser(__doc__)
    ap.add_argument("--seed", type=int, default=0, help="base seed of the in-process batch "
                    "(the subprocesses use tyingspec's default, 0)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-verdicts", action="store_true")
    a = ap.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows when redirected to a file
    shape = (a.V, a.d, a.N)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.skip_timing:
            timing(shape, a.repeats, a.seed, tmp)
        if not a.skip_verdicts:
            verdicts(shape, tmp)
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
