"""``tyingspec check``: run a target over seeded cases through the engine, shrink a failure,
build replay lines; tell a :class:`front.progress.Progress` what it is doing; a quick check
(``--quick``) stops once each path has had a case with the power to see it."""

from __future__ import annotations

import contextlib
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.cases import Case, at_shape, batch_problem
from tyingspec._src.core.extras import with_hint
from tyingspec._src.core.kind import Kind, KindSpec
from tyingspec._src.core.options import DEFAULT_SHRINK_BUDGET, DEFAULT_TIMEOUT, UsageError
from tyingspec._src.engine.observe import (
    Observation,
    PrecisionChoice,
    Target,
    described,
    load,
    observe,
    phases_to,
    shaped,
)
from tyingspec._src.engine.warm import WarmTargets
from tyingspec._src.front.results import CaseResult, CheckReport, Quick
from tyingspec._src.kinds.table import kind_spec

if TYPE_CHECKING:  # annotations only: the progress line's module loads when one is shown
    from tyingspec._src.front.progress import Progress


#: The largest shape a proxy of a wrong case has: small enough that a shrinking step costs
#: milliseconds, big enough that a repeated token and an absent row both occur.
PROXY_SHAPE = (64, 8, 32)


@dataclass
class ShrinkBudget:
    """The run's time for shrinking, shared by its cases.

    A shrinking step is one more evaluation of the target.  At a production shape a step costs
    as much as the case itself, so a budget per case would make a broken kernel several times
    dearer than a correct one.  The run has ``seconds`` in all, and never spends more than
    ``share`` of what its cases' own evaluations took: a broken target then costs at most
    (1 + share) times a correct one.  A label is shrunk once per run.
    """

    seconds: float
    share: float = 0.5
    floor: float = 1.0  # what a run may always spend (its cases may take milliseconds)
    spent: float = 0.0
    evaluated: float = 0.0  # seconds the cases' own evaluations took so far
    shrunk: dict[str, str] = field(default_factory=dict)  # label -> the case shrunk for it

    def left(self) -> float:
        allowed = min(self.seconds, max(self.floor, self.share * self.evaluated))
        return max(0.0, allowed - self.spent)


def shrink(target: Target, case: Case, label: str, budget: float = DEFAULT_SHRINK_BUDGET,
           step_cost: float = 0.0) -> tuple[Case, str]:
    """Delete positions while the same diagnosis label persists (keeps E, W, b), for at most
    ``budget`` seconds, starting a step only when ``step_cost`` (what one evaluation of this
    case took) still fits; returns the smallest case found and a note when time ran out."""
    start = time.monotonic()
    deadline = start + budget
    tokens = np.asarray(case.tokens, dtype=np.int64)
    targets = np.asarray(case.targets, dtype=np.int64)
    changed = True
    while changed and tokens.shape[0] > 1:
        changed = False
        for i in range(tokens.shape[0]):
            if time.monotonic() + step_cost > deadline:
                if tokens.shape[0] == case.N:
                    return case, (f"not shrunk: one more evaluation ({step_cost:.2g} s) does "
                                  f"not fit the {budget:.2g} s left of the run's shrink budget")
                return (case.with_batch(tokens, targets),
                        f"shrinking stopped after {time.monotonic() - start:.2g} s (the run's "
                        f"shrink budget) at N={tokens.shape[0]}")
            t2, y2 = np.delete(tokens, i), np.delete(targets, i)
            try:
                obs = observe(target, case.with_batch(t2, y2))
            except AdapterError:
                continue
            if obs.label == label:
                tokens, targets, changed = t2, y2, True
                break
    return case.with_batch(tokens, targets), ""


def proxy_of(case: Case, kind: KindSpec | None = None) -> Case | None:
    """The same case (seed, composition, options) at :data:`PROXY_SHAPE`, where every shape is
    larger; None when the case is already that small or is defined by its shape."""
    V, d, N = (min(a, b) for a, b in zip((case.V, case.d, case.N), PROXY_SHAPE))
    if (V, d, N) == (case.V, case.d, case.N) or case.tokens is not None:
        return None
    kept, _ = at_shape([case], V, d, N, kind)
    return kept[0] if kept else None


def shrink_in_run(target: Target, case: Case, obs: Observation, cost: float,
                  budget: ShrinkBudget) -> tuple[Case | None, str]:
    """Shrink a wrong case (``case`` as asked for, ``obs`` as observed) within the run's
    budget; (the smallest case, a note on what was done instead of or besides shrinking the
    case itself)."""
    label = obs.label
    if budget.seconds <= 0:  # --shrink-budget 0: shrinking is off
        return None, ""
    if label in budget.shrunk:
        return None, f"not shrunk: case {budget.shrunk[label]} has the same label and was shrunk"
    t0 = time.monotonic()
    try:
        # shrinking the case itself takes about N evaluations of it
        proxy = proxy_of(case, target.kind) if cost * obs.case.N > budget.left() else None
        if proxy is not None:
            # the rows and the path are already named at full size: shrink where a step is
            # cheap, on the same case at a small shape, if it shows the same label there
            try:
                seen = observe(target, proxy)
            except AdapterError:
                seen = None
            if seen is not None and seen.label == label:
                budget.shrunk[label] = obs.case.name
                small, note = shrink(target, seen.case, label, budget.left())
                where = (f"shrunk on a proxy of this case at V={proxy.V} d={proxy.d} "
                         f"N={proxy.N}, which shows the same label; the full-size batch was not "
                         "shrunk")
                return small, where + (f"; {note}" if note else "")
        budget.shrunk[label] = obs.case.name
        small, note = shrink(target, obs.case, label, budget.left(), step_cost=cost)
        return (None if small is obs.case else small), note
    finally:
        budget.spent += time.monotonic() - t0


def replay_command(target: Target, base_seed: int, case: Case) -> str:
    parts = ["tyingspec", "check", target.spec, "--kind", target.kind.name, "--seed",
             str(base_seed), "--case", case.name]
    if target.precision != "auto":
        parts += ["--precision", target.precision]
    for key, _ in target.kind.flags:  # --autocast, --compile
        value = case.setting_value(key)
        if value:
            parts += [f"--{key}", value]
    if case.given_shape:  # --shape, or a proxy of a case at it
        parts += ["--shape", f"{case.V},{case.d},{case.N}"]
    if case.padding_idx is not None and case.probe:
        parts += ["--padding-idx", str(case.padding_idx)]
    if case.tokens is not None and case.targets is not None:
        targets = ",".join(map(str, case.targets))
        # an ignored target (-100) would read as an option: then --targets=... is spelled out
        parts += ["--tokens", ",".join(map(str, case.tokens))] + (
            [f"--targets={targets}"] if targets.startswith("-") else ["--targets", targets])
    return shlex.join(parts)


def result_of(target: Target, obs: Observation, base_seed: int) -> CaseResult:
    """A case result from an observation (no shrinking)."""
    return CaseResult(obs.case, obs.status, diagnosis=obs.diagnosis,
                      mutated=obs.returned.mutated, stage=obs.stage,
                      replay=replay_command(target, base_seed, obs.case),
                      precision=obs.precision, precision_note=obs.precision_note)


def run_case(target: Target, case: Case, base_seed: int, *, do_shrink: bool = True,
             shrink_budget: float | ShrinkBudget = DEFAULT_SHRINK_BUDGET,
             checks: tuple[str, ...] | None = None, progress: Progress | None = None,
             keep_rows: bool = False) -> CaseResult:
    """Observe one case through the engine; shrink a wrong one to its smallest batch, within
    the run's :class:`ShrinkBudget` (a number: this case's own budget).  ``checks``: the
    kind's own checks to run (a torch model's, see ``KindSpec.quick_checks``), else all of them;
    ``progress`` is told each phase; ``keep_rows`` keeps each row's error for ``--html``."""
    budget = shrink_budget if isinstance(shrink_budget, ShrinkBudget) else ShrinkBudget(
        shrink_budget, share=float("inf"))
    t0 = time.monotonic()
    try:
        with phases_to(progress.phase) if progress is not None else contextlib.nullcontext():
            obs = observe(target, case) if checks is None else \
                observe(target, case, checks=checks)
    except AdapterError as exc:
        return CaseResult(case, "adapter_error", error=with_hint(str(exc)),
                          replay=replay_command(target, base_seed, case))
    cost = time.monotonic() - t0
    budget.evaluated += cost
    result = result_of(target, obs, base_seed)
    if keep_rows:
        # lazy: the picture's module loads only when a picture is drawn
        from tyingspec._src.front.html import row_profile

        result.rows = row_profile(obs)
    if obs.status == "wrong" and do_shrink and obs.case.N > 1:
        if progress is not None:
            progress.phase("shrinking")
        result.shrunk, result.shrink_note = shrink_in_run(target, case, obs, cost, budget)
        if result.shrunk is not None:
            result.replay = replay_command(target, base_seed, result.shrunk)
    return result


def explicit_batch_problem(target: Target, case: Case) -> str | None:
    """Why a case's explicit batch (``--tokens/--targets``) cannot reach ``target``: ids
    outside the vocabulary, known only once a torch model is loaded, or an ignored target
    (-100) for a linear-ce kernel that declares no ``ignore_index``.  Without this a torch
    model raises an IndexError inside its embedding, a traceback instead of a usage error."""
    if case.tokens is None and case.targets is None:
        return None
    ignore = target.kind.ignore_index()
    problem = batch_problem(case.tokens, case.targets, case.V, ignore_index=ignore)
    if problem is not None or ignore is None or ignore not in (case.targets or ()):
        return problem
    if "ignore_index" not in described(target).get("options", ()):
        return (f"a target of {ignore} is an ignored token, and the kernel declares no "
                "ignore_index option")
    return None


#: What a quick check wants a case with the power to see, one each (``Diagnosis.power``).
PATHS = ("input_path", "output_path", "duplicates")


def _decided(result: CaseResult, seen: set[str]) -> bool:
    """Whether a quick check can stop after ``result``, ``seen`` the paths its earlier cases
    had the power to see (updated): a verdict that no later case can take back (a wrong
    gradient, an adapter error), or every path seen.  A case whose rows are the model's own
    (a use not observed) and that a check with power vouched for counts for every path."""
    if result.status in ("wrong", "adapter_error"):
        return True
    d = result.diagnosis
    if d is not None and not d.rows_compared:
        seen.update(PATHS if result.status == "correct" else ())
    elif d is not None:
        seen.update(p for p in PATHS if getattr(d.power, p))
    return seen >= set(PATHS)


def _cases_to_run(target: Target, cases: list[Case], report: CheckReport) -> list[Case]:
    """``cases`` as the target takes them (its notes on what it left out go to ``report``);
    UsageError when none is left or one's explicit batch does not fit."""
    cases, report.notes = shaped(target, cases)
    if not cases:
        # every case left out by the target itself (a torch model's shape, a linear-ce
        # kernel's options): zero cases is no verdict, and "correct" would pass a CI gate
        # that checked nothing
        raise UsageError("no case left to run, so there is no verdict: "
                         + "; ".join(report.notes))
    for case in cases:
        problem = explicit_batch_problem(target, case)
        if problem is not None:
            raise UsageError(f"case {case.name}: {problem}")
    return cases


def _run_cases(target: Target, cases: list[Case], report: CheckReport, seed: int, *,
               shrink_budget: float, on_result: Any, progress: Progress | None, quick: bool,
               keep_rows: bool) -> None:
    """Each case in turn into ``report`` (``quick``: until every path has been seen)."""
    # a model's batch shape is its own: a smaller batch is not one it takes
    do_shrink = not target.kind.own_shape
    budget = ShrinkBudget(shrink_budget)
    checks = target.kind.quick_checks if quick else None
    seen: set[str] = set()
    for index, case in enumerate(cases, 1):
        if progress is not None:
            progress.case_started(case.name, index, len(cases))
        t0 = time.monotonic()
        result = run_case(target, case, seed, shrink_budget=budget, do_shrink=do_shrink,
                          checks=checks, progress=progress, keep_rows=keep_rows)
        if progress is not None:
            progress.case_ended(result.status, time.monotonic() - t0)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
        if quick and _decided(result, seen):
            break
    if quick:
        report.quick = Quick(len(report.results), len(cases), checks)


def check_target(spec: str, kind: Kind | KindSpec, seed: int, cases: list[Case] | None = None, *,
                 precision: PrecisionChoice = "auto", shrink_budget: float = DEFAULT_SHRINK_BUDGET,
                 on_result: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 paths: tuple[str, ...] = (), warm: WarmTargets | None = None,
                 progress: Progress | None = None, quick: bool = False,
                 keep_rows: bool = False) -> CheckReport:
    """Resolve ``spec`` and run it on every case; adapter errors are recorded, the run goes on.
    A ``module:attr`` target runs in a worker process (``paths`` first on its ``sys.path``,
    ``timeout`` seconds per call).  ``on_result(result)`` is called as each case finishes.
    ``cases`` default to the kind's own (a linear-ce kernel's, a torch model's).  With
    ``warm``, the target is taken from there and left loaded for the next check.

    ``progress`` is told the target's loading, each case's start and end and each phase.
    ``quick``: the cases run in order until each path (input, output, repeated tokens) has
    had one with the power to see it, or one is wrong or an adapter error, with the kind's
    ``KindSpec.quick_checks``; ``report.quick`` says how many ran of how many.  ``keep_rows``
    keeps each case's rows for a picture (``front.html``)."""
    # the public signature takes a kind's name too (``tyingspec.check_target``): converted
    # here, at that boundary, and the spec passed down from here on
    table = kind if isinstance(kind, KindSpec) else kind_spec(kind)
    report = CheckReport(spec, table.name, seed, precision=precision)
    if cases is None:
        cases = table.cases(seed)
    if not cases:
        raise UsageError("no case to run, so there is no verdict")
    if progress is not None:
        progress.loading(spec)
    try:
        target = load(spec, table, precision, timeout=timeout, paths=paths, prepare=cases[:1]) \
            if warm is None else warm.get(spec, table, precision, timeout=timeout, paths=paths,
                                          prepare=cases[:1])
    except AdapterError as exc:
        report.load_error = with_hint(str(exc))
        return report
    try:
        try:
            cases = _cases_to_run(target, cases, report)
        except AdapterError as exc:
            report.load_error = with_hint(str(exc))
            return report
        _run_cases(target, cases, report, seed, shrink_budget=shrink_budget,
                   on_result=on_result, progress=progress, quick=quick, keep_rows=keep_rows)
    finally:
        if warm is None:
            target.close()
        else:
            warm.settle(target)  # what the target started ends with the check
    return report
