"""Experiment 1: every entry of dE from three implementations against central differences."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tyingspec._src.core.diagnosis import diagnose
from tyingspec._src.core.paths import closed_form_paths, loss_only
from tyingspec._src.core.tolerance import Tolerance
from tyingspec._src.kinds.probe.builtins import REGISTRY
from tyingspec._src.reproduce._common import (
    NOT_JUDGED,
    ProgressFactory,
    Result,
    Row,
    direction_row,
    save_figure,
    silent_progress,
)

NAME = "gradient-table"
TITLE = "which rows of dE each implementation gets right, checked entry by entry"
SOURCE = "write-up: V = 64, a batch with exactly 8 distinct tokens"

V, D, N, DISTINCT = 64, 16, 24, 8
RES, S_IN, SIGMA = 1.0, 1.0, 0.25  # sigma = 1/sqrt(d)
STEP = 1e-6
# Central differences in float64 with step h carry ~eps*|L|/h rounding error (~1e-10) and
# ~h^2 truncation error; a tolerance 1e3x above that still separates a missing path (~1e-3).
FD_RTOL, FD_ATOL_SCALE = 1e-6, 1e-6

#: (implementation, claimed wrong rows) — the claims of the write-up.
CLAIMS: dict[str, int] = {"tied": 0, "output-path-only": 8, "input-path-only": 64}
EXTRA = ("untied-sum", "duplicates-buffered")  # shown too, no claim attached

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Example:
    E: F64
    W: F64
    tokens: NDArray[np.int64]
    targets: NDArray[np.int64]


def make_example(seed: int, *, V: int = V, d: int = D, n: int = N,
                 distinct: int = DISTINCT) -> Example:
    """A batch of ``n`` positions using exactly ``distinct`` tokens, each at least once."""
    rng = np.random.default_rng(seed)
    vocab = rng.choice(V, size=distinct, replace=False)
    tokens = np.concatenate([vocab, rng.choice(vocab, size=n - distinct)])
    rng.shuffle(tokens)
    targets = rng.integers(0, V, size=n)
    E = rng.normal(0.0, SIGMA, size=(V, d))
    W = rng.normal(0.0, 1.0 / np.sqrt(d), size=(d, d))
    return Example(E, W, tokens.astype(np.int64), targets.astype(np.int64))


def central_dE(ex: Example, *, step: float = STEP) -> F64:
    """dL/dE by central differences on every entry, both uses of E perturbed together."""
    E = ex.E.copy()
    grad = np.zeros_like(E)
    for r in range(E.shape[0]):
        for c in range(E.shape[1]):
            keep = E[r, c]
            E[r, c] = keep + step
            up = loss_only(E, E, ex.W, None, ex.tokens, ex.targets, RES, S_IN)
            E[r, c] = keep - step
            down = loss_only(E, E, ex.W, None, ex.tokens, ex.targets, RES, S_IN)
            E[r, c] = keep
            grad[r, c] = (up - down) / (2 * step)
    return grad


def fd_tolerance(reference: F64) -> Tolerance:
    scale = float(np.max(np.abs(reference)))
    return Tolerance(atol=FD_ATOL_SCALE * scale + 1e-300, rtol=FD_RTOL, dtype="float64")


def implementation_dE(name: str, ex: Example) -> F64:
    model = REGISTRY[name].model
    assert model is not None
    return np.asarray(model(ex.E, ex.W, None, ex.tokens, ex.targets, res=RES, s_in=S_IN)["dE"],
                      dtype=np.float64)


def check(name: str, ex: Example, fd: F64) -> dict[str, Any]:
    dE = implementation_dE(name, ex)
    tol = fd_tolerance(fd)
    ok = tol.close(dE, fd)
    row_ok = ok.all(axis=1)
    paths = closed_form_paths(ex.E, ex.W, None, ex.tokens, ex.targets, RES, S_IN)
    diag = diagnose(dE, paths)
    err = np.abs(dE - fd).max(axis=1)
    return {
        "rows_wrong": int((~row_ok).sum()),
        "rows_exact": int(row_ok.sum()),
        "entries_wrong": int((~ok).sum()),
        "entries": int(ok.size),
        "wrong_rows": [int(r) for r in np.flatnonzero(~row_ok)],
        "row_max_abs_error": err,
        "diagnosis": diag.label,
        "atol": tol.atol,
        "rtol": tol.rtol,
    }


def run(seeds: Sequence[int] = (0,), *, quick: bool = False,
        progress: ProgressFactory = silent_progress) -> Result:
    """Compute the table for every seed; the claims must hold for each one."""
    t0 = time.perf_counter()
    names = list(CLAIMS) + [n for n in EXTRA if n in REGISTRY]
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    present: dict[int, list[int]] = {}
    with progress("central differences", len(seeds)) as bar:
        for seed in seeds:
            ex = make_example(seed)
            fd = central_dE(ex)
            present[seed] = sorted(int(t) for t in set(ex.tokens.tolist()))
            per_seed[seed] = {n: check(n, ex, fd) for n in names}
            bar.advance()
    first = per_seed[seeds[0]]
    rows: list[Row] = []
    for name in names:
        wrong = [per_seed[s][name]["rows_wrong"] for s in seeds]
        same = len(set(wrong)) == 1
        w = wrong[0]
        exact = V - w
        measured = f"{w} wrong, {exact} of {V} exact ({100 * exact / V:.1f}%)"
        if not same:
            measured = f"varies by seed: {wrong}"
        if name in CLAIMS:
            c = CLAIMS[name]
            claim = f"{c} wrong, {V - c} of {V} exact ({100 * (V - c) / V:.1f}%)"
            ok = same and w == c
            why_not = (f"wrong rows {wrong} over seeds {list(seeds)}" if not ok else "")
            rows.append(direction_row(
                f"{name}: rows wrong", claim, measured, ok,
                f"every one of {V * D} entries compared in each of {len(seeds)} "
                f"seed{'s' if len(seeds) > 1 else ''}; "
                f"diagnosis: {first[name]['diagnosis']}", why_not,
                claim_value=c, measured_value=wrong if not same else w))
        else:
            rows.append(Row(f"{name}: rows wrong", "(no claim)", measured, NOT_JUDGED,
                            f"diagnosis: {first[name]['diagnosis']}", None,
                            wrong if not same else w))
    seed0 = seeds[0]
    repeated = int(np.sum(np.bincount(make_example(seed0).tokens) > 1))
    notes = [
        f"Rows of the {DISTINCT} tokens in the batch (seed {seed0}): {present[seed0]}; "
        f"{repeated} of them occur more than once, which is why duplicates-buffered is wrong "
        "on those rows only.",
        f"Tolerance for central differences (step {STEP:g}, float64): |a - e| <= "
        f"{FD_ATOL_SCALE:g}*max|e| + {FD_RTOL:g}*|e|, per entry; a row is exact when all {D} "
        "of its entries pass.",
    ]
    series = {
        "per_seed": {str(s): {n: {k: v for k, v in per_seed[s][n].items()} for n in names}
                     for s in seeds},
        "present_rows": {str(s): present[s] for s in seeds},
    }
    return Result(
        NAME, TITLE, SOURCE,
        setup={
            "V": V, "d": D, "N": N,
            "task": f"one batch of N={N} positions using exactly {DISTINCT} distinct tokens "
                    "(each at least once, the rest drawn from those 8), targets uniform over V",
            "model": f"probe model, V={V}, d={D}, res={RES:g}, s_in={S_IN:g}, no bias",
            "init": f"E ~ N(0, {SIGMA:g}^2) (1/sqrt(d)), W ~ N(0, 1/d)",
            "optimizer": "none (gradient at initialisation)",
            "steps": 0,
            "check": f"all {V}x{D} entries of dE against central differences (step {STEP:g})",
        },
        rows=rows, series=series, notes=notes, seeds=list(seeds),
        elapsed_s=time.perf_counter() - t0,
    )


def plot(result: Result, path: Path, plt: Any) -> Path:
    seed = str(result.seeds[0])
    data = result.series["per_seed"][seed]
    names = list(data)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.4))
    for i, name in enumerate(names):
        wrong = set(data[name]["wrong_rows"])
        colors = ["#d62728" if r in wrong else "#2ca02c" for r in range(V)]
        ax.scatter(range(V), [i] * V, c=colors, marker="s", s=38)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n} ({data[n]['rows_wrong']} wrong)" for n in names])
    ax.set_xlabel(f"row of dE (token id); red = some entry disagrees with central differences "
                  f"(seed {seed})")
    ax.set_xlim(-1, V)
    ax.invert_yaxis()
    ax.set_title(f"Gradient table: rows of dE that match central differences, V = {V}, "
                 f"{DISTINCT} tokens")
    return save_figure(fig, path)
