"""The built-in demonstration: the write-up's table, computed, not typed in."""

from __future__ import annotations

from dataclasses import dataclass

from tyingspec._src.core.cases import Case, build, case_seed
from tyingspec._src.core.kind import Implementation
from tyingspec._src.core.render import exact_cell, rows_text
from tyingspec._src.engine.observe import load
from tyingspec._src.front.check import run_case
from tyingspec._src.front.results import CaseResult
from tyingspec._src.kinds.table import DEFAULT_KIND, kind_spec

#: (table label, built-in name) in the order of the write-up's table.
TABLE_ROWS = (("both paths, +=", "tied"), ("output path only", "output-path-only"),
              ("input path only", "input-path-only"))
EXTRA = ("untied-sum", "duplicates-buffered")


def _builtins() -> dict[str, Implementation]:
    """The zoo the demo draws its rows from: the default kind's (the probe model's)."""
    return kind_spec(DEFAULT_KIND).builtins()


def demo_case(seed: int) -> Case:
    # V = 64 and a batch holding exactly 8 distinct tokens, some repeated (as real batches are).
    return Case(name="write-up-batch", V=64, d=16, N=16, seed=case_seed(seed, "write-up-batch"),
                composition="repeats", distinct=8, bias=False)


@dataclass
class Demo:
    case: Case
    results: dict[str, CaseResult]

    @property
    def as_expected(self) -> bool:
        return all(r.diagnosis is not None and r.diagnosis.label == _builtins()[n].expected
                   for n, r in self.results.items())


def run_demo(seed: int) -> Demo:
    case = demo_case(seed)
    names = [n for _, n in TABLE_ROWS] + list(EXTRA)
    return Demo(case, {n: run_case(load(n, DEFAULT_KIND), case, seed, do_shrink=False)
                       for n in names})


def render_demo(demo: Demo) -> str:
    batch = build(demo.case)
    distinct = sorted({int(t) for t in batch.tokens})
    lines = [
        f"tyingspec: the built-in tied model and its broken variants on one batch "
        f"(V = {demo.case.V}, d = {demo.case.d}, N = {demo.case.N} positions holding "
        f"{len(distinct)} distinct tokens {distinct}, seed {demo.case.seed})",
        "",
        "| gradient into E | wrong rows | rows still exactly right |",
        "|---|---|---|",
    ]
    for label, name in TABLE_ROWS:
        d = demo.results[name].diagnosis
        assert d is not None
        lines.append(f"| {label} | {d.rows_wrong} | {exact_cell(d)} |")
    lines += ["", "diagnoses:"]
    for name in [n for _, n in TABLE_ROWS] + list(EXTRA):
        impl, d = _builtins()[name], demo.results[name].diagnosis
        assert d is not None
        where = f"; wrong rows {rows_text(d.wrong_rows)}" if d.wrong_rows else ""
        lines.append(f"  {name} ({impl.description}):")
        lines.append(f"    {d.headline()}{where}")
    ok = demo.as_expected
    lines.append("")
    lines.append("every built-in diagnosed as expected" if ok else
                 "MISMATCH: a built-in was not diagnosed as its registry entry expects")
    lines.append("check your own implementation: tyingspec check module:function "
                 "[--kind model|kernel]")
    return "\n".join(lines)
