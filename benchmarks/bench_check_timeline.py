"""Where one cold `tyingspec check` goes at GPT-2 size: a timeline of the engine's phases.

    python -m benchmarks.bench_check_timeline
    python -m benchmarks.bench_check_timeline --V 2000 --d 64 --N 256

Runs the command ``bench_check`` times as (b), ``tyingspec check benchmarks.torch_probe:tied_f32
--precision float32 --shape V,d,N --case absent-tokens --shrink-budget 0``, in this process and
in the console script's order (``front.entry.main``): the worker is started from the arguments
before numpy loads (``w.launch_early``) and this process gives way to it (``front.entry.NICE``);
then the command runs (``front.cli.main``) with each phase of the engine and of the worker's
protocol wrapped in a timer.  It prints every phase as (start, seconds, CPU seconds, name): the
start counted from this script's first line, the CPU seconds those of this process (all its
threads) during the phase.  The phases: the batch and reference built while the worker imports
the target (``_prepare``), waiting for the import (``w.wait_loaded``), each call (``w.submit``
sends the inputs, ``w.collect`` waits for the answer), judging, the SGD step and the second
call's reference.  ``worker loaded`` is when the worker's answer to its import arrived (a thread
polls the channel, reading nothing), and the last line says how much of the reference ran
beside the import.  One run: read it beside ``bench_check``'s (F) and ``floor_parts``.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.launch import shape_parser  # noqa: E402
from tyingspec._src.front.entry import NICE, early_target, load_numpy  # noqa: E402

#: (start, seconds, name, CPU seconds of this process in it; NaN for an instant)
EVENTS: list[tuple[float, float, str, float]] = []


def _parser() -> argparse.ArgumentParser:
    ap = shape_parser(__doc__, repeats=None)
    ap.add_argument("--reference-parts", action="store_true",
                    help="also time the reference's parts (its two products, the softmax, "
                         "the bound's terms, the paths and the sketch's directions)")
    return ap


def command(a: argparse.Namespace) -> list[str]:
    """The arguments of the timed command."""
    return ["check", "benchmarks.torch_probe:tied_f32", "--precision", "float32",
            "--shape", f"{a.V},{a.d},{a.N}", "--case", "absent-tokens", "--shrink-budget",
            "0", "--json", os.devnull]


def _start_early(argv: Sequence[str]) -> None:
    """What ``front.entry.main`` does before numpy loads: start the worker, give way to it."""
    early = early_target(argv)
    if early is None:
        return
    from tyingspec._src.core.options import target_paths
    from tyingspec._src.engine.isolation import launch_early

    launch_early(early[0], early[1], target_paths(), early[2])
    EVENTS.append((time.perf_counter() - T0, 0.0, "w.launch_early", math.nan))
    with contextlib.suppress(AttributeError, OSError):
        os.nice(NICE)


ARGS = _parser().parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    _start_early(command(ARGS))
load_numpy()  # as the console script does, before anything loads numpy (see front.entry)

import tyingspec._src.engine.isolation as iso  # noqa: E402
import tyingspec._src.engine.observe as ob  # noqa: E402
from tyingspec._src.front import cli  # noqa: E402
from tyingspec._src.kinds.table import KINDS as KIND_TABLE  # noqa: E402

Record = Callable[[float, float, str], None]  # (started, seconds, label)


def wrapped(label: str, f: Callable[..., Any], record: Record) -> Callable[..., Any]:
    """``f``, each call of it passed to ``record`` with its start time and duration."""
    def wrapper(*a: Any, **k: Any) -> Any:
        s = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            record(s, time.perf_counter() - s, label)
    return wrapper


def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f``, each call of it in ``EVENTS`` with its start, its seconds and the CPU seconds
    this process spent in it, both clocks read at the same two moments."""
    def run(*a: Any, **k: Any) -> Any:
        c, s = time.process_time(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            EVENTS.append((s - T0, time.perf_counter() - s, label, time.process_time() - c))
    return run


def quiet_command(argv: Sequence[str]) -> tuple[int, str]:
    """``tyingspec ARGV`` in this process (``front.cli.main``): its exit code and the last
    line of its report, which is not printed."""
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    lines = report.getvalue().strip().splitlines()
    return code, lines[-1] if lines else ""


def watch_loading(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.launch``, followed by a thread that records (as ``worker loaded``) when the
    worker's first answer, the one to its import, can be read.  It polls without reading, and
    the engine reads that answer only later, after its reference."""
    def launched(self: Any) -> None:
        launch(self)
        conn = self._conn

        def poll() -> None:
            try:
                conn.poll(60.0)
            except (EOFError, OSError):
                return
            EVENTS.append((time.perf_counter() - T0, 0.0, "worker loaded", math.nan))

        threading.Thread(target=poll, daemon=True).start()
    return launched


def overlap(events: Sequence[tuple[float, float, str, float]]) -> str:
    """How much of the first reference ran before the worker had loaded."""
    loaded = [s for s, _, name, _ in events if name == "worker loaded"]
    refs = sorted((s, dt) for s, dt, name, _ in events if name == "reference")
    if not loaded or not refs:
        return "the worker's load or the reference was not seen"
    start, seconds = refs[0]
    beside = max(0.0, min(start + seconds, loaded[0]) - start)
    return (f"the reference ran {beside:.2f} s of its {seconds:.2f} s beside the worker's "
            f"import (loaded at {loaded[0]:.2f} s), {seconds - beside:.2f} s after it")


def main(argv: Sequence[str] | None = None) -> int:
    a = ARGS if ARGS is not None and argv is None else _parser().parse_args(argv)
    for name in ("batch_for", "judge", "sgd_step", "_prepare", "first_call", "_first_judged",
                 "_second_judged"):
        setattr(ob, name, timed(name, getattr(ob, name)))
    if a.reference_parts:
        from tyingspec._src.core import paths

        for name in ("_times_rows_T", "_times_rows", "_softmax_in_place", "model_terms",
                     "two_paths", "draw_directions"):
            setattr(paths, name, timed(f"  {name}", getattr(paths, name)))
    iso.Worker.launch = watch_loading(iso.Worker.launch)  # type: ignore[method-assign]
    for name in ("launch", "wait_loaded", "submit", "collect"):
        setattr(iso.Worker, name, timed(f"w.{name}", getattr(iso.Worker, name)))
    table = KIND_TABLE["model"]
    object.__setattr__(table, "reference", timed("reference", table.reference))
    started = time.perf_counter() - T0
    argv_ = command(a)
    code, verdict = quiet_command(argv_)
    end = time.perf_counter() - T0
    print(f"== one cold check at V={a.V} d={a.d} N={a.N}, float32 (exit {code}): imports "
          f"{started:.2f} s, the command {end - started:.2f} s, {end:.2f} s in all")
    print(verdict)
    print(f"{'start':>7} {'seconds':>8} {'CPU s':>6}  phase (CPU: this process, all threads)")
    for s, dt, label, cpu in sorted(EVENTS):
        if label != "w.wait_loaded" or dt >= 0.01:  # the engine looks often, without waiting
            print(f"{s:7.2f} {dt:8.2f} {cpu:6.2f}  {label}")
    print(overlap(EVENTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
