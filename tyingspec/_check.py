"""Run a target over seeded cases: call, validate, diagnose, shrink a failure, build replay lines."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._adapters import AdapterError, call_kernel, call_model, resolve
from ._cases import Batch, Case, build, closed_form, kernel_inputs, sgd_step
from ._diagnosis import ArrayCheck, Diagnosis, compare, diagnose
from ._tolerance import tolerance_for

STATUSES = ("correct", "no_power", "wrong", "adapter_error")
FIRST_CALL, AFTER_STEP = "first call", "after one SGD step"


@dataclass
class CaseResult:
    """Outcome of one case: a diagnosis, or the adapter error that prevented one."""

    case: Case
    status: str
    diagnosis: Diagnosis | None = None
    error: str | None = None
    mutated: tuple[str, ...] = ()
    shrunk: Case | None = None
    replay: str = ""
    stage: str = FIRST_CALL  # which call the diagnosis is of (models are called twice)

    def as_dict(self) -> dict[str, Any]:
        c = self.case
        d: dict[str, Any] = {
            "name": c.name, "seed": c.seed, "V": c.V, "d": c.d, "N": c.N, "res": c.res,
            "s_in": c.s_in, "bias": c.bias, "dtype": c.dtype, "status": self.status,
            "error": self.error, "mutated_inputs": list(self.mutated), "replay": self.replay,
            "stage": self.stage,
        }
        if self.diagnosis is not None:
            dd = self.diagnosis.as_dict()
            d.update({k: dd[k] for k in ("label", "detail", "rows_total", "rows_wrong",
                                         "rows_exact", "wrong_rows", "max_abs_error",
                                         "max_rel_error", "power")})
            d["diagnosis"] = dd
        if self.shrunk is not None:
            d["smallest_batch"] = {"tokens": list(self.shrunk.tokens or ()),
                                   "targets": list(self.shrunk.targets or ())}
        return d


def _model_call(spec: str, fn: Callable[..., Any], batch: Batch,
                dtype: str) -> tuple[Diagnosis, tuple[str, ...], np.ndarray]:
    paths = closed_form(batch)
    out = call_model(spec, fn, batch.E, batch.W, batch.b, batch.tokens, batch.targets,
                     res=batch.res, s_in=batch.s_in)
    others: list[ArrayCheck] = [
        compare("loss", out.loss, paths.loss, tolerance_for(dtype, paths.loss)),
        compare("dW", out.dW, paths.dW, tolerance_for(dtype, paths.dW)),
    ]
    if paths.db is not None and out.db is not None:
        others.append(compare("db", out.db, paths.db, tolerance_for(dtype, paths.db)))
    diag = diagnose(out.dE, paths, dtype=dtype, others=others, mutated=out.mutated)
    return diag, out.mutated, out.dE


def _evaluate(spec: str, fn: Callable[..., Any], kind: str, batch: Batch,
              dtype: str) -> tuple[Diagnosis, tuple[str, ...], str]:
    """Diagnose one case; a model is called twice: at E, then at E stepped by SGD with the dE it
    returned, because a tie that is a copy made at initialisation, or a gradient buffer that is
    never zeroed, is right on the first call and wrong from the second on."""
    if kind == "kernel":
        parts, paths = kernel_inputs(batch)
        dE, mutated = call_kernel(spec, fn, batch.tokens, parts.input_rows, parts.h, parts.g,
                                  batch.E.shape[0])
        return diagnose(dE, paths, dtype=dtype, mutated=mutated), mutated, FIRST_CALL
    diag, mutated, dE = _model_call(spec, fn, batch, dtype)
    stepped = None if diag.wrong or mutated else sgd_step(batch, dE)
    if stepped is None:
        return diag, mutated, FIRST_CALL
    diag1, mutated1, _ = _model_call(spec, fn, stepped[0], dtype)
    if diag1.wrong or mutated1:
        return diag1, mutated1, AFTER_STEP
    return diag, mutated, FIRST_CALL


def _status(diag: Diagnosis, mutated: tuple[str, ...]) -> str:
    if diag.wrong or mutated:
        return "wrong"
    return "no_power" if diag.label == "no_power" else "correct"


def shrink(spec: str, fn: Callable[..., Any], kind: str, case: Case, label: str) -> Case:
    """Greedily delete positions while the same diagnosis label persists; keeps E, W, b."""
    batch = build(case)
    tokens, targets = batch.tokens, batch.targets
    changed = True
    while changed and tokens.shape[0] > 1:
        changed = False
        for i in range(tokens.shape[0]):
            t2, y2 = np.delete(tokens, i), np.delete(targets, i)
            trial = case.with_batch(t2, y2)
            try:
                diag, _, _ = _evaluate(spec, fn, kind, build(trial), case.dtype)
            except AdapterError:
                continue
            if diag.label == label:
                tokens, targets, changed = t2, y2, True
                break
    return case.with_batch(tokens, targets)


def replay_command(spec: str, kind: str, base_seed: int, case: Case) -> str:
    parts = ["tyingspec", "check", spec, "--kind", kind, "--seed", str(base_seed),
             "--case", case.name]
    if case.tokens is not None and case.targets is not None:
        parts += ["--tokens", ",".join(map(str, case.tokens)),
                  "--targets", ",".join(map(str, case.targets))]
    return shlex.join(parts)


def run_case(spec: str, fn: Callable[..., Any], kind: str, case: Case, base_seed: int,
             *, do_shrink: bool = True) -> CaseResult:
    try:
        diag, mutated, stage = _evaluate(spec, fn, kind, build(case), case.dtype)
    except AdapterError as exc:
        return CaseResult(case, "adapter_error", error=str(exc),
                          replay=replay_command(spec, kind, base_seed, case))
    status = _status(diag, mutated)
    result = CaseResult(case, status, diagnosis=diag, mutated=mutated, stage=stage,
                        replay=replay_command(spec, kind, base_seed, case))
    if status == "wrong" and diag.wrong and do_shrink:
        result.shrunk = shrink(spec, fn, kind, case, diag.label)
        result.replay = replay_command(spec, kind, base_seed, result.shrunk)
    return result


@dataclass
class CheckReport:
    """All case results for one target, and the overall verdict and exit status."""

    target: str
    kind: str
    seed: int
    results: list[CaseResult] = field(default_factory=list)
    load_error: str | None = None

    @property
    def verdict(self) -> str:
        if self.load_error or any(r.status == "adapter_error" for r in self.results):
            return "adapter_error"
        if any(r.status == "wrong" for r in self.results):
            return "wrong"
        if self.results and all(r.status == "no_power" for r in self.results):
            return "no_power"
        return "correct"

    @property
    def exit_code(self) -> int:
        return {"correct": 0, "no_power": 1, "wrong": 1, "adapter_error": 2}[self.verdict]

    @property
    def diagnosis_label(self) -> str:
        labels = [r.diagnosis.label for r in self.results
                  if r.diagnosis is not None and r.status == "wrong"]
        if not labels:
            return self.verdict
        return max(set(labels), key=labels.count)


def check_target(spec: str, kind: str, seed: int, cases: list[Case]) -> CheckReport:
    """Resolve ``spec`` and run it on every case; adapter errors are recorded, the run goes on."""
    report = CheckReport(spec, kind, seed)
    try:
        fn = resolve(spec, kind)
    except AdapterError as exc:
        report.load_error = str(exc)
        return report
    for case in cases:
        report.results.append(run_case(spec, fn, kind, case, seed))
    return report
