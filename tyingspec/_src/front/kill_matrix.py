"""The kill matrix: every property against every mutant in the zoo (tyingspec's power, shown).

For each mutant and each kind it comes in, every user-facing property that applies to the kind
is run with Hypothesis (derandomized unless a seed is given, bounded examples, no database).
A property *kills* a mutant when it raises :class:`PropertyFailure`; Hypothesis then shrinks the
batch, and the shrunk batch (``PropertyFailure.case``, tokens spelled out) is recorded.  The
mutation score is the share of (mutant, kind) rows killed by at least one property; every
correct implementation (the built-ins and the styles) must pass every property on the same
examples.  ``tyingspec mutants`` prints the matrix and exits 0 only when the score is 100% and
every style passes.

The default matrix stops a mutant's row at its first kill: the verdict needs "killed, and by
what label", not every property that could kill it, and a property that survives costs its
whole example budget (on the torch and distributed kinds, a model run per example).  The
properties it did not run are marked ``-`` (``not_run`` in the JSON).  ``--full`` runs every
property against every mutant; the correct implementations run every property either way
(a false alarm anywhere is the failure the matrix exists to catch).  The rows run in
``--jobs`` processes (default: one per core), each row whole in one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.cases import Case
from tyingspec._src.core.files import OutputError, atomic_write, usable_output
from tyingspec._src.core.kind import Implementation, KindSpec
from tyingspec._src.core.options import UsageError, positive_int
from tyingspec._src.core.options import seed as option_seed
from tyingspec._src.kinds.table import KIND_NAMES, every_builtin, kind_spec
from tyingspec._src.kinds.table import KINDS as TABLE

SCHEMA = "tyingspec.mutants/1"
KINDS = KIND_NAMES
DEFAULT_MAX_EXAMPLES = 30

KILLED, SURVIVED, PASSED, FAILED, ERROR, NO_EVIDENCE = (
    "killed", "survived", "passed", "failed", "error", "no_evidence")


@dataclass
class Cell:
    """One property run against one implementation (of one kind)."""

    prop: str
    status: str  # killed/survived for a mutant, passed/failed for a style; error; no_evidence
    examples: int  # examples that ran to completion (passed) or failed; discards excluded
    discarded: int
    seconds: float
    case: Case | None = None  # the shrunk batch that failed
    label: str | None = None  # the failure's diagnosis label
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (KILLED, FAILED)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "examples": self.examples, "discarded": self.discarded,
                "seconds": round(self.seconds, 3), "label": self.label,
                "batch": None if self.case is None else batch_dict(self.case),
                "message": self.message}


@dataclass
class Row:
    """An implementation of one kind and its cells, one per applicable property."""

    name: str
    kind: str
    breaks: str | None
    expected: str
    cells: dict[str, Cell] = field(default_factory=dict)
    # The kill label: the verdict `tyingspec check NAME` reaches on its standard cases (the
    # engine both front ends share).  The smallest killing batch may carry a weaker label:
    # shrunk to one present token, a padding mask *is* a missing input path.
    label: str | None = None
    # properties that apply to the kind but were not run: the row stopped at its first kill
    not_run: list[str] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return self.breaks is None

    @property
    def killed_by(self) -> list[str]:
        return [p for p, c in self.cells.items() if c.failed]

    @property
    def ok(self) -> bool:
        """A mutant row is ok when killed; a style row when every property passed."""
        if self.correct:
            return all(c.status == PASSED for c in self.cells.values())
        return bool(self.killed_by)

    def smallest(self) -> Cell | None:
        """The killing cell with the smallest shrunk batch (fewest positions, then V, then d)."""
        kills = [c for c in self.cells.values() if c.failed and c.case is not None]
        if not kills:
            return None
        return min(kills, key=lambda c: (c.case.N, c.case.V, c.case.d))  # type: ignore[union-attr]

    def as_dict(self) -> dict[str, Any]:
        small = self.smallest()
        return {"name": self.name, "kind": self.kind, "breaks": self.breaks,
                "expected": self.expected, "ok": self.ok, "killed_by": self.killed_by,
                "label": self.label,
                "smallest": None if small is None else
                {"property": small.prop, "label": small.label,
                 "batch": batch_dict(small.case)},  # type: ignore[arg-type]
                "cells": {p: c.as_dict() for p, c in self.cells.items()},
                "not_run": list(self.not_run)}


@dataclass
class PowerReport:
    """The kill matrix, the styles' results, and the verdict."""

    properties: list[tuple[str, str, tuple[str, ...]]]  # (name, invariant, kinds)
    mutants: list[Row]
    styles: list[Row]
    max_examples: int
    seed: int | None
    seconds: float = 0.0
    full: bool = True  # False: each mutant's row stopped at its first kill

    @property
    def killed(self) -> int:
        return sum(r.ok for r in self.mutants)

    @property
    def score(self) -> float:
        return self.killed / len(self.mutants) if self.mutants else 1.0

    @property
    def styles_pass(self) -> bool:
        return all(r.ok for r in self.styles)

    @property
    def ok(self) -> bool:
        return self.killed == len(self.mutants) and self.styles_pass

    def as_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "max_examples": self.max_examples, "seed": self.seed,
                "derandomized": self.seed is None, "seconds": round(self.seconds, 2),
                "full": self.full,
                "properties": [{"name": n, "invariant": i, "kinds": list(k)}
                               for n, i, k in self.properties],
                "score": self.score, "killed": self.killed, "total": len(self.mutants),
                "styles_pass": self.styles_pass, "ok": self.ok,
                "mutants": [r.as_dict() for r in self.mutants],
                "styles": [r.as_dict() for r in self.styles]}


def batch_dict(case: Case) -> dict[str, Any]:
    """A shrunk batch as builtin types (JSON- and xdist-safe)."""
    return {"V": case.V, "d": case.d, "N": case.N, "seed": case.seed, "res": case.res,
            "s_in": case.s_in, "bias": case.bias, "dtype": case.dtype,
            "composition": case.composition, "e_scale": case.e_scale,
            "tokens": list(case.tokens or ()), "targets": list(case.targets or ())}


def batch_text(case: Case) -> str:
    return (f"tokens={list(case.tokens or ())} targets={list(case.targets or ())} "
            f"({case.describe()})")


def run_property(prop: Any, impl: Implementation, kind: str, *, max_examples: int,
                 seed: int | None = None) -> Cell:
    """Run one property against one implementation with Hypothesis; stop at the first failure
    (then shrink it).  State of stateful mutants is reset first, so runs do not interact."""
    # Hypothesis loads here, not at import: the CLI builds this command's parser on every run.
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Flaky, Unsatisfiable, UnsatisfiedAssumption
    from hypothesis.strategies import SearchStrategy

    # lazy: every command's start-up builds this module's parser: the engine, the check
    # and hypothesis (the properties) stay out of it
    from tyingspec._src.engine.observe import load
    from tyingspec.properties import PropertyFailure, label_locked

    _reset(kind_spec(kind))
    target = load(impl.name, kind)
    counts = {"examples": 0, "discarded": 0}
    check = label_locked(prop.check)

    def body(case: Case) -> None:
        try:
            check(target, case)
        except UnsatisfiedAssumption:
            counts["discarded"] += 1
            raise
        except BaseException:
            counts["examples"] += 1
            raise
        counts["examples"] += 1

    # a model's batch shape is its own (torch): shrinking the drawn case cannot shrink the
    # batch, only re-run the model on other tokens
    phases = (Phase.explicit, Phase.generate) if kind_spec(kind).own_shape else \
        (Phase.explicit, Phase.generate, Phase.shrink)
    budget = settings(
        max_examples=max_examples, derandomize=seed is None, database=None, deadline=None,
        phases=phases, report_multiple_bugs=False,
        verbosity=Verbosity.quiet, print_blob=False, suppress_health_check=list(HealthCheck))
    strategy: SearchStrategy[Case] = prop.strategy()
    test: Callable[[], None] = budget(given(strategy)(body))
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    bad, good = (KILLED, SURVIVED) if not impl.correct else (FAILED, PASSED)
    t0 = time.perf_counter()

    def cell(status: str, **kw: Any) -> Cell:
        return Cell(prop.name, status, counts["examples"], counts["discarded"],
                    time.perf_counter() - t0, **kw)

    try:
        test()
    except PropertyFailure as exc:
        return cell(bad, case=exc.case, label=exc.label, message=str(exc))
    except AdapterError as exc:
        return cell(ERROR, message=str(exc))
    except Unsatisfiable as exc:
        return cell(NO_EVIDENCE, message=str(exc))
    except Flaky as exc:  # a stateful implementation failing only on some replays: still a kill
        inner = _first_failure(exc)
        if inner is not None:
            return cell(bad, case=inner.case, label=inner.label, message=f"flaky: {inner}")
        return cell(bad, message=f"flaky: {exc}")
    return cell(good)


def _first_failure(exc: BaseException) -> Any:
    # lazy: every command's start-up builds this module's parser: the engine, the check
    # and hypothesis (the properties) stay out of it
    from tyingspec.properties import PropertyFailure

    if isinstance(exc, PropertyFailure):
        return exc
    for sub in getattr(exc, "exceptions", ()):
        found = _first_failure(sub)
        if found is not None:
            return found
    return None


def _reset(spec: KindSpec) -> None:
    """The kind's stateful built-ins as new: no row's verdict depends on the rows before it."""
    if spec.reset is not None:
        spec.reset()


def run_row(impl: Implementation, kind: str, *, max_examples: int,
            seed: int | None = None, properties: Iterable[str] | None = None,
            first_kill: bool = False) -> Row:
    """Every applicable property against one implementation of one kind; with
    ``first_kill``, a mutant's properties stop at the first that kills it (the rest are listed
    in ``Row.not_run``).  A correct implementation runs every property either way."""
    # lazy: every command's start-up builds this module's parser: the engine, the check
    # and hypothesis (the properties) stay out of it
    from tyingspec._src.front.check import check_target
    from tyingspec.properties import for_kind

    wanted = None if properties is None else set(properties)
    row = Row(impl.name, kind, impl.breaks, impl.expected)
    _reset(kind_spec(kind))
    row.label = check_target(impl.name, kind, 0, kind_spec(kind).cases(0),
                             shrink_budget=0.0).diagnosis_label
    for prop in for_kind(kind):
        if wanted is not None and prop.name not in wanted:
            continue
        if first_kill and not impl.correct and row.killed_by:
            row.not_run.append(prop.name)
            continue
        row.cells[prop.name] = run_property(prop, impl, kind, max_examples=max_examples,
                                            seed=seed)
    return row


def targets(kinds: Sequence[str] = KINDS, names: Iterable[str] | None = None
            ) -> list[tuple[Implementation, str]]:
    """(implementation, kind) pairs to run: every registry entry in every kind it has."""

    pairs: list[tuple[Implementation, str]] = []
    shared = every_builtin()
    for k in kinds:  # each kind runs its own zoo (the probe kinds share theirs)
        known = kind_spec(k).builtins()
        chosen = [i for n, i in known.items() if names is None or n in set(names)]
        pairs += [(impl, k) for impl in chosen if impl.adapter(k) is not None]
    order = {id(impl): i for i, impl in enumerate(shared.values())}
    return sorted(pairs, key=lambda p: (order.get(id(p[0]), len(order)), KINDS.index(p[1])))


def kill_matrix(*, kinds: Sequence[str] = KINDS, max_examples: int = DEFAULT_MAX_EXAMPLES,
                seed: int | None = None, names: Iterable[str] | None = None,
                progress: Callable[[int, int, Row, float], None] | None = None,
                full: bool = False, jobs: int = 1) -> PowerReport:
    """Run the properties against every mutant (each row up to its first kill unless
    ``full``) and every property against every correct implementation, the rows in ``jobs``
    processes; ``progress(done, total, row, elapsed)`` is called after each row."""
    # lazy: every command's start-up builds this module's parser: the engine, the check
    # and hypothesis (the properties) stay out of it
    from tyingspec.properties import PROPERTIES

    t0 = time.perf_counter()
    todo = targets(kinds, names)

    def done(i: int, row: Row) -> None:
        if progress is not None:
            progress(i, len(todo), row, time.perf_counter() - t0)

    if jobs > 1 and len(todo) > 1:
        rows = _rows_in_processes(todo, min(jobs, len(todo)), max_examples, seed, full, done)
    else:
        rows = []
        for i, (impl, kind) in enumerate(todo, 1):
            rows.append(run_row(impl, kind, max_examples=max_examples, seed=seed,
                                first_kill=not full))
            done(i, rows[-1])
    mutants = [r for r, (impl, _) in zip(rows, todo) if not impl.correct]
    styles = [r for r, (impl, _) in zip(rows, todo) if impl.correct]
    props = [(p.name, p.invariant, p.kinds) for p in PROPERTIES.values()
             if any(k in p.kinds for k in kinds)]
    return PowerReport(props, mutants, styles, max_examples, seed, time.perf_counter() - t0,
                       full=full)


def _row_job(name: str, kind: str, max_examples: int, seed: int | None, full: bool) -> Row:
    """One row in a pool process: the implementation looked up there by name (built-ins only:
    the pool does not see registry entries added at run time)."""
    return run_row(kind_spec(kind).builtins()[name], kind, max_examples=max_examples,
                   seed=seed, first_kill=not full)


def _rows_in_processes(todo: Sequence[tuple[Implementation, str]], jobs: int,
                       max_examples: int, seed: int | None, full: bool,
                       done: Callable[[int, Row], None]) -> list[Row]:
    """The rows of ``todo`` in ``jobs`` fresh processes (spawned: no torch or JAX state
    forked), in ``todo``'s order; each process keeps its imports and loaded models for the
    rows it runs next."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # the rows of kinds that import a framework (torch, jax) first: they cost the most, and a
    # long row started last would run alone while the other processes sit idle
    order = sorted(range(len(todo)), key=lambda i: (kind_spec(todo[i][1]).needs is None, i))
    rows: dict[int, Row] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_row_job, todo[i][0].name, todo[i][1], max_examples, seed,
                               full): i for i in order}
        for n, future in enumerate(as_completed(futures), 1):
            rows[futures[future]] = future.result()
            done(n, rows[futures[future]])
    return [rows[i] for i in range(len(todo))]


def render(report: PowerReport) -> str:
    """The kill matrix as text: rows mutant/kind, one column per property, then the verdict."""
    props = [p for p, _, _ in report.properties]
    mode = ("derandomized" if report.seed is None else f"seed {report.seed}") + (
        "" if report.full else "; each mutant up to its first kill, --full for every cell")
    lines = [(f"tyingspec mutants: {len(report.mutants)} mutant forms x {len(props)} "
              f"properties, at most {report.max_examples} examples per property ({mode}, "
              f"{report.seconds:.1f} s)"), ""]
    for i, (name, inv, kinds) in enumerate(report.properties, 1):
        lines.append(f"  [{i:>2}] {name} ({inv}; {'/'.join(kinds)})")
    lines += ["", ("kill matrix: K killed, . survived, E adapter error, ? no evidence, "
                   "- not run (after the first kill), blank: does not apply to the kind")]
    width = max([len(f"{r.name} ({r.kind})") for r in report.mutants + report.styles] + [10])
    head = " ".join(f"{i:>2}" for i in range(1, len(props) + 1))
    lines.append(f"  {'mutant (kind)':<{width}}  {head}  killed by")
    mark = {KILLED: "K", SURVIVED: ".", PASSED: ".", FAILED: "F", ERROR: "E", NO_EVIDENCE: "?"}

    def cell_mark(r: Row, p: str) -> str:
        return mark[r.cells[p].status] if p in r.cells else "-" if p in r.not_run else ""

    for r in report.mutants:
        cells = " ".join(f"{cell_mark(r, p):>2}" for p in props)
        lines.append(f"  {r.name + ' (' + r.kind + ')':<{width}}  {cells}  {len(r.killed_by)}"
                     + ("" if r.ok else "  SURVIVED"))
    lines += ["", (f"mutation score: {report.killed}/{len(report.mutants)} = "
                   f"{100.0 * report.score:.1f}%"), "", "smallest batch that killed each mutant:"]
    for r in report.mutants:
        small = r.smallest()
        if small is None or small.case is None:
            lines.append(f"  {r.name} ({r.kind}): survived every property")
            continue
        note = "" if r.label == r.expected else f" (registry expects {r.expected})"
        lines.append(f"  {r.name} ({r.kind}) [{r.label}]{note} by {small.prop} "
                     f"[{small.label}]: {batch_text(small.case)}")
    lines += ["", "correct implementations (every property must pass): F failed, . passed"]
    for r in report.styles:
        cells = " ".join(f"{cell_mark(r, p):>2}" for p in props)
        lines.append(f"  {r.name + ' (' + r.kind + ')':<{width}}  {cells}  "
                     + ("ok" if r.ok else "FAILED"))
        for p, c in r.cells.items():
            if c.status != PASSED:
                lines.append(f"      {p}: {c.message.splitlines()[0] if c.message else c.status}")
                if c.case is not None:
                    lines.append(f"      smallest failing batch: {batch_text(c.case)}")
    lines.append("")
    lines.append("OK: every mutant killed, every correct implementation passes" if report.ok else
                 "NOT OK: " + ("; ".join(
                     ([f"{len(report.mutants) - report.killed} mutant(s) survived"]
                      if report.killed < len(report.mutants) else [])
                     + ([] if report.styles_pass else ["a correct implementation failed"]))))
    return "\n".join(lines)


def _mutant_name(text: str) -> str:

    known = set(every_builtin())
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"no implementation {text!r}; known: {', '.join(sorted(known))}")
    return text


def progress_printer(stream: Any = None) -> Callable[[int, int, Row, float], None]:
    """Progress of the kill matrix on stderr: a bar redrawn in place on a terminal, one plain
    line per row otherwise (CI logs keep every line)."""
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())

    def show(done: int, total: int, row: Row, elapsed: float) -> None:
        verdict = ("ok" if row.ok else "NOT OK") + (f" [{row.label}]" if row.label else "")
        if tty:
            width = 30
            filled = width * done // total
            out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                      f"{elapsed:5.0f} s  {row.name} ({row.kind}) {verdict}\033[K")
            if done == total:
                out.write("\n")
        else:
            out.write(f"mutants: {done}/{total} {row.name} ({row.kind}) {verdict} "
                      f"({elapsed:.0f} s)\n")
        out.flush()

    return show


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Options of ``tyingspec mutants``."""
    p.description = p.description or (
        "Run every property against every mutant in the zoo and every correct implementation: "
        "print the kill matrix (mutant x property), the mutation score and the smallest batch "
        "that killed each mutant. Exit 0 when the score is 100% and every correct "
        "implementation passes, 1 otherwise.")
    p.add_argument("--kind", choices=(*KIND_NAMES, "all"), default="all",
                   help="adapter kinds to run (default: all)")
    p.add_argument("--json", metavar="PATH", help=f"write a {SCHEMA} JSON report")
    p.add_argument("--max-examples", type=positive_int, default=DEFAULT_MAX_EXAMPLES,
                   metavar="N", help="Hypothesis examples per property and implementation "
                                     f"(default {DEFAULT_MAX_EXAMPLES})")
    p.add_argument("--seed", type=option_seed, default=None,
                   help="Hypothesis seed (default: derandomized, the same examples every run)")
    p.add_argument("--only", type=_mutant_name, action="append", metavar="NAME",
                   help="run only this implementation (repeatable)")
    p.add_argument("--full", action="store_true",
                   help="run every property against every mutant (default: each mutant up "
                        "to the first property that kills it; the correct implementations "
                        "run every property either way)")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="processes to run the rows in (default: one per core, here "
                        f"{os.cpu_count() or 1}); 1 runs them in this process")


def _nothing_to_run(names: Sequence[str], kinds: Sequence[str]) -> str:
    """Why ``--only NAMES`` selects no (implementation, kind) pair under ``kinds``."""

    have: dict[str, list[str]] = {}
    for k, spec in TABLE.items():
        known = spec.builtins()
        for n in names:
            impl = known.get(n)
            if impl is not None and impl.adapter(k) is not None:
                have.setdefault(n, []).append(k)
    where = "; ".join(f"{n} comes in --kind {' or '.join(have[n])}" if n in have else
                      f"{n} comes in no kind" for n in names)
    return (f"nothing to run: no implementation named by --only comes in --kind "
            f"{' or '.join(kinds)} ({where})")


def _require_extras(pairs: Sequence[tuple[Implementation, str]], every_kind: bool) -> None:
    """What the rows import, before the run, not after the first hour of it: each kind's own
    module (torch for the torch and distributed zoos, jax for the jax one) and what a built-in
    needs beyond its kind (the torch-form linear-ce built-ins)."""
    # lazy: every command's start-up builds this module's parser, and needs no extras
    from tyingspec._src.core.extras import require

    def needed(impl: Implementation, kind: str) -> str | None:
        spec = TABLE[kind]
        own = None if spec.builtin_needs is None else spec.builtin_needs(impl.name)
        return own or spec.needs

    by_module: dict[str, set[str]] = {}
    for impl, kind in pairs:
        module = needed(impl, kind)
        if module is not None:
            by_module.setdefault(module, set()).add(kind)
    for module, kinds in sorted(by_module.items()):
        rows = sorted(kinds)
        require(module, f"--kind all (its {' and '.join(rows)} rows; --kind model and "
                "--kind kernel run without it)" if every_kind else
                " and ".join(f"--kind {k}" for k in rows))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tyingspec mutants``; returns the exit status (2 for a usage error:
    nothing selected, an unusable --json path, a missing extra; raised as UsageError)."""
    kinds = KINDS if args.kind == "all" else (args.kind,)
    # before the run: a --json that cannot be written must not cost the whole matrix
    path = None
    if args.json is not None:
        try:
            path = usable_output("--json", args.json)
        except OutputError as exc:
            raise UsageError(str(exc)) from None
    pairs = targets(kinds, args.only)
    if not pairs:
        # an empty matrix "kills every mutant" (0/0): that is no result, not an OK
        raise UsageError(_nothing_to_run(args.only or (), kinds))
    _require_extras(pairs, args.kind == "all")
    report = kill_matrix(kinds=kinds, max_examples=args.max_examples, seed=args.seed,
                         names=args.only, progress=progress_printer(), full=args.full,
                         jobs=args.jobs)
    print(render(report), flush=True)
    code = 0 if report.ok else 1
    if path is not None:
        try:
            atomic_write(path, json.dumps(report.as_dict(), indent=2) + "\n")
        except OSError as exc:
            print(f"tyingspec mutants: the JSON report {args.json} was not written "
                  f"({type(exc).__name__}: {exc}); the matrix above stands", file=sys.stderr)
            return max(code, 2)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tyingspec._src.front.kill_matrix``: the same as ``tyingspec mutants``."""

    parser = argparse.ArgumentParser(prog="tyingspec mutants")
    configure_parser(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        parser.error(str(exc))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
