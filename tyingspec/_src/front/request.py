"""One check as asked for, by ``tyingspec check`` or by ``tyingspec.check(...)``: the target, its
kind and the options that choose its cases, validated once for both front ends.

:meth:`CheckRequest.problems` lists what is wrong with it (each problem names the option, what
it takes and what it was given).  The command line prints them and exits 2; the API raises them
as a :class:`UsageError` (a ``ValueError``).  So the two reject the same inputs with the same
message, and the API no longer borrows the command line's private helpers.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from tyingspec._src.core.cases import at_shape, batch_problem, memory_problem
from tyingspec._src.core.extras import require, target_imports
from tyingspec._src.core.options import UsageError, available_memory, target_paths
from tyingspec._src.kinds.table import DEFAULT_KIND, kind_spec
from tyingspec._src.kinds.table import builtin_kind as table_kind

if TYPE_CHECKING:
    from tyingspec._src.core.cases import Case
    from tyingspec._src.core.kind import KindSpec

__all__ = ["CheckRequest", "builtin_kind", "flagged"]

def builtin_kind(target: str) -> str:
    """The kind ``tyingspec check TARGET`` runs without --kind: a built-in's own (the first
    that has it: model before kernel; a torch or linear-ce zoo name its zoo's), else model."""
    if ":" in target:
        return DEFAULT_KIND
    return table_kind(target) or DEFAULT_KIND


def flagged(spec: KindSpec, cases: list[Case], **flags: str | None) -> list[Case]:
    """``cases`` with the command line's settings (``--autocast``, ``--compile``) set on each,
    for a kind that takes them (ValueError naming the flag and the kinds that do)."""
    given = {k: v for k, v in flags.items() if v is not None}
    takes = dict(spec.flags)
    for key, value in given.items():
        if key not in takes:
            raise ValueError(f"--{key} does not apply to --kind {spec.name}")
        if value not in takes[key]:
            raise ValueError(f"--{key} {value}: expected one of {', '.join(takes[key])}")
        cases = [c.with_setting(key, value) for c in cases]
    return cases


@dataclass(frozen=True)
class Plan:
    """What a request comes to: the cases to run and the notes on those left out, or the
    problems that stop it (then no case runs)."""

    cases: list[Case] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CheckRequest:
    """A check as asked for.  ``kind`` None: :func:`builtin_kind`; ``cases`` None: the kind's
    own seeded cases; the rest are the command line's options of the same name."""

    target: str
    kind: str | None = None
    seed: int = 0
    precision: str = "auto"
    cases: tuple[Case, ...] | None = None
    case: str | None = None
    shape: tuple[int, ...] | None = None
    autocast: str | None = None
    compile: str | None = None
    device: str | None = None
    padding_idx: int | None = None
    tokens: tuple[int, ...] | None = None
    targets: tuple[int, ...] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckRequest:
        """The request ``tyingspec check`` was given (``args.target`` is set)."""
        return cls(args.target, args.kind, args.seed, args.precision, case=args.case,
                   shape=args.shape, autocast=args.autocast, compile=args.compile,
                   device=args.device, padding_idx=args.padding_idx, tokens=args.tokens,
                   targets=args.targets)

    @property
    def kind_name(self) -> str:
        """The kind the check runs as: ``kind``, else the built-in's own, else model."""
        return self.kind or builtin_kind(self.target)

    def problems(self) -> list[str]:
        """What is wrong with the request, each naming the option, what it takes and what it
        got; empty when the check can run."""
        return list(self.plan.problems)

    def chosen(self) -> tuple[list[Case], list[str]]:
        """The cases to run and the notes on those left out; :class:`UsageError` (a
        ``ValueError``) with the problems when there are any."""
        if self.plan.problems:
            raise UsageError("; ".join(self.plan.problems))
        return self.plan.cases, self.plan.notes

    @functools.cached_property
    def plan(self) -> Plan:
        """The options applied in the command line's order: a problem at one step stops the
        steps that take its cases (a case named, then left out by --shape, is told why)."""
        try:
            spec = kind_spec(self.kind_name)
        except ValueError as exc:
            return Plan(problems=[str(exc)])
        problems = self._option_problems(spec)
        try:
            cases = flagged(spec, list(self.cases) if self.cases is not None else
                            spec.cases(self.seed), autocast=self.autocast, device=self.device,
                            compile=self.compile)
        except ValueError as exc:
            problems.insert(0, str(exc))
        if problems:
            return Plan(problems=problems)
        notes: list[str] = []
        steps = (self._named_case, self._at_shape, self._padded, self._left, self._batch)
        for step in steps:
            cases, problem = step(spec, cases, notes)
            if problem is not None:
                return Plan(notes=notes, problems=[problem])
        return Plan(cases, notes)

    def _option_problems(self, spec: KindSpec) -> list[str]:
        """Options wrong whatever the cases: --tokens without --targets, --padding-idx for a
        kind that takes none, a shape that is not three positive integers."""
        problems = []
        if (self.tokens is None) != (self.targets is None):
            problems.append("--tokens and --targets go together")
        elif self.tokens is not None and not self.case:
            problems.append("--tokens/--targets need --case")
        shape = self.shape
        if shape is not None and (len(shape) != 3 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
            problems.append(f"--shape takes V,d,N, three positive integers; got {shape!r}")
        if self.padding_idx is not None:
            if spec.no_padding_flag is not None:
                problems.append(f"--padding-idx applies to --kind model (a {spec.name} target "
                                + spec.no_padding_flag + ")")
            elif self.padding_idx < 0:
                problems.append(
                    f"--padding-idx must be a row index >= 0, got {self.padding_idx}")
        return problems

    def _named_case(self, spec: KindSpec, cases: list[Case], notes: list[str]
                    ) -> tuple[list[Case], str | None]:
        # --case first: a case named here and then left out by --shape or --padding-idx is
        # told why below, not reported as unknown
        if not self.case:
            return cases, None
        chosen = [c for c in cases if c.name == self.case]
        if not chosen:
            return cases, (f"--case: no case {self.case!r}; known: "
                           + ", ".join(c.name for c in cases))
        return chosen, None

    def _at_shape(self, spec: KindSpec, cases: list[Case], notes: list[str]
                  ) -> tuple[list[Case], str | None]:
        if self.shape is None:
            return cases, None
        V, d, N = self.shape
        # a model with a shape of its own (a torch model) keeps its V and d, checked against
        # the model once it is loaded, and takes N as its batch x sequence
        problem = None if spec.own_shape else memory_problem(
            V, d, max(N, len(self.tokens or ())), available_memory(), self.precision,
            spec)
        if problem is not None:
            return cases, f"--shape {V},{d},{N}: {problem}; choose a smaller shape"
        cases, left_out = at_shape(cases, V, d, N, spec)
        if left_out:
            notes.append(f"--shape {V},{d},{N}: left out {', '.join(left_out)} "
                         "(defined by their shape)")
        return cases, None

    def _padded(self, spec: KindSpec, cases: list[Case], notes: list[str]
                ) -> tuple[list[Case], str | None]:
        padding_idx = self.padding_idx
        if padding_idx is None:
            return cases, None
        small = [c.name for c in cases if c.V <= padding_idx]
        if small:
            notes.append(f"--padding-idx {padding_idx}: left out {', '.join(small)} "
                         "(no such row: their V is at most "
                         f"{max(c.V for c in cases if c.V <= padding_idx)})")
        return [replace(c, padding_idx=padding_idx) for c in cases if c.V > padding_idx], None

    def _left(self, spec: KindSpec, cases: list[Case], notes: list[str]
              ) -> tuple[list[Case], str | None]:
        if not cases:
            # Zero cases is no verdict: "correct" here would pass a CI gate that checked nothing.
            return cases, "no case left to run, so there is no verdict: " + "; ".join(notes)
        return cases, None

    def _batch(self, spec: KindSpec, cases: list[Case], notes: list[str]
               ) -> tuple[list[Case], str | None]:
        if self.tokens is None or self.targets is None:
            return cases, None
        # a kind with its own shape (a torch model's vocabulary) has its token ids checked
        # once the model is loaded (front.check.check_target)
        if not spec.own_shape:
            # a target may be the kind's ignored id (linear-ce's -100): an ignored token
            problem = batch_problem(self.tokens, self.targets, cases[0].V,
                                    ignore_index=spec.ignore_index())
            if problem is not None:
                return cases, f"--tokens/--targets: {problem} (case {cases[0].name})"
        return [cases[0].with_batch(np.asarray(self.tokens), np.asarray(self.targets))], None

    def require_extras(self) -> None:
        """Before anything runs: the extras this check needs are installed (else a usage error
        naming the ``pip install``).  What is imported deeper down is caught by the CLI's
        ``main``; the API leaves it to the report (an adapter error)."""
        target, kind, precision = self.target, self.kind_name, self.precision
        spec = kind_spec(kind)
        if spec.needs is not None:  # a transformers model without torch: both extras at once
            require(spec.needs, f"--kind {kind}", lambda: _target_imports(target, kind),
                    target if ":" in target else f"the built-in {target}")
        if precision == "bfloat16":
            require("ml_dtypes", "--precision bfloat16")
        builtin_needs = None if ":" in target or spec.builtin_needs is None else \
            spec.builtin_needs(target)
        if builtin_needs is not None:
            require(builtin_needs, f"the built-in {target} (a {builtin_needs} module)")


def _target_imports(target: str, kind: str) -> frozenset[str]:
    """The modules ``target`` imports, read from its source (a built-in's from its factory)."""
    impl = None if ":" in target else kind_spec(kind).builtins().get(target)
    return target_imports(target, target_paths(), impl and impl.adapter(kind))

