"""Experiment 2: how often a sampled-entry gradient check passes the output-path-only bug."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tyingspec._src.core.diagnosis import diagnose
from tyingspec._src.core.paths import closed_form_paths
from tyingspec._src.reproduce._common import (
    NOT_JUDGED,
    ProgressFactory,
    Result,
    Row,
    direction_row,
    save_figure,
    silent_progress,
)
from tyingspec._src.reproduce._gradient_table import (
    DISTINCT,
    RES,
    S_IN,
    SIGMA,
    STEP,
    D,
    N,
    V,
    central_dE,
    fd_tolerance,
    implementation_dE,
    make_example,
)

NAME = "blind-spot"
TITLE = "sampled-entry checks vs the row-complete check on the output-path-only variant"
SOURCE = "write-up / NOTES: passes with probability about (56/64)^k, 26% at k = 10"

BROKEN = "output-path-only"
KS = tuple(range(1, 51))
TRIALS = 1000
POOL = 25  # distinct examples whose every entry is checked by central differences


def closed_form(k: int, wrong: int, total: int) -> tuple[float, float]:
    """P(all k sampled entries are right): with replacement, and without (hypergeometric)."""
    with_repl = (1 - wrong / total) ** k
    without = math.comb(total - wrong, k) / math.comb(total, k) if k <= total - wrong else 0.0
    return with_repl, without


def run(seeds: Sequence[int] = (0,), *, quick: bool = False,
        progress: ProgressFactory = silent_progress, trials: int | None = None,
        pool: int | None = None) -> Result:
    """Sampled checks over ``trials`` trials per k, and the row-complete check on every trial."""
    t0 = time.perf_counter()
    trials = trials if trials is not None else (100 if quick else TRIALS)
    pool = pool if pool is not None else (5 if quick else POOL)
    seed = seeds[0]
    rng = np.random.default_rng(seed)
    example_seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=pool)]
    total = V * D

    # Which entries a central-difference check would flag, for each example in the pool.
    wrong_masks = []
    with progress("central differences", pool) as bar:
        for s in example_seeds:
            ex = make_example(s)
            fd = central_dE(ex)
            dE = implementation_dE(BROKEN, ex)
            wrong_masks.append(~fd_tolerance(fd).close(dE, fd).reshape(-1))
            bar.advance()
    wrong_counts = [int(m.sum()) for m in wrong_masks]
    wrong = int(np.median(wrong_counts))

    measured = np.zeros(len(KS))
    with progress("sampled checks", len(KS)) as bar:
        for i, k in enumerate(KS):
            passes = 0
            for t in range(trials):
                mask = wrong_masks[t % pool]
                picked = rng.choice(total, size=k, replace=False)
                passes += not mask[picked].any()
            measured[i] = passes / trials
            bar.advance()
    repl = np.array([closed_form(k, wrong, total)[0] for k in KS])
    hyper = np.array([closed_form(k, wrong, total)[1] for k in KS])

    # tyingspec's row-complete check: a fresh example in every trial.
    caught = 0
    labels: dict[str, int] = {}
    with progress("row-complete checks", trials) as bar:
        for _ in range(trials):
            ex = make_example(int(rng.integers(0, 2**31 - 1)))
            paths = closed_form_paths(ex.E, ex.W, None, ex.tokens, ex.targets, RES, S_IN)
            diag = diagnose(implementation_dE(BROKEN, ex), paths)
            labels[diag.label] = labels.get(diag.label, 0) + 1
            caught += diag.wrong
            bar.advance()

    # Agreement of measured and closed form: binomial standard error at each k, 4 sigma.
    se = np.sqrt(np.maximum(hyper * (1 - hyper), 1e-12) / trials)
    z = np.abs(measured - hyper) / np.maximum(se, 1.0 / trials)
    worst = int(np.argmax(z))
    k10 = KS.index(10)
    rows: list[Row] = [
        direction_row(
            "wrong entries in dE (of 1024)", f"8 rows x {D} = {8 * D}",
            f"{wrong} (pool of {pool}: {min(wrong_counts)}-{max(wrong_counts)})",
            min(wrong_counts) == max(wrong_counts) == 8 * D,
            "the 8 present rows, every entry", "some present-row entry within tolerance",
            claim_value=8 * D, measured_value=wrong),
        direction_row(
            "P(pass) at k = 10, closed form", "about 26% ((56/64)^10)",
            f"{100 * repl[k10]:.1f}% with replacement, {100 * hyper[k10]:.1f}% without",
            round(100 * repl[k10]) == 26, "(7/8)^10 = 26.3%", "closed form differs",
            claim_value=0.26, measured_value=float(hyper[k10])),
        direction_row(
            "P(pass) at k = 10, measured", "about 26%",
            f"{100 * measured[k10]:.1f}% ({trials} trials)",
            abs(measured[k10] - hyper[k10]) <= 4 * se[k10] + 1e-12,
            f"within 4 binomial s.e. ({100 * se[k10]:.1f} pts) of the closed form",
            "outside 4 binomial s.e. of the closed form",
            claim_value=0.26, measured_value=float(measured[k10])),
        direction_row(
            "measured matches closed form, k = 1..50", "yes",
            f"largest gap {abs(measured[worst] - hyper[worst]):.3f} at k = {KS[worst]} "
            f"({z[worst]:.1f} s.e.)",
            bool(z.max() <= 4.0), "every k within 4 binomial s.e.",
            "some k is more than 4 binomial s.e. away", claim_value=None,
            measured_value=float(z.max())),
        Row("sampled check: smallest k with P(pass) < 1%", "(no claim)",
            f"k = {next((k for k, p in zip(KS, hyper, strict=True) if p < 0.01), '>50')} "
            "(closed form)",
            NOT_JUDGED, "a sampled check needs this many entries to catch the bug 99% of the "
            "time; the row-complete check needs one pass"),
        direction_row(
            "row-complete check catches it", f"every trial ({trials} of {trials})",
            f"{caught} of {trials}; labels {labels}", caught == trials,
            "diagnosis names the dropped input path in every trial",
            "some trial passed the broken variant", claim_value=trials, measured_value=caught),
    ]
    notes = [
        f"Sampled check: k distinct entries of the {V}x{D} dE drawn uniformly; each is compared "
        f"with its central difference (step {STEP:g}); the check passes when all k agree. The "
        f"central differences of every entry of {pool} examples are computed once and each "
        f"trial uses example (trial mod {pool}) with a fresh draw of entries.",
        "Closed form without replacement: C(M-w, k)/C(M, k) with M = 1024 entries, w = 128 "
        "wrong; with replacement (1 - w/M)^k = (56/64)^k, the figure the write-up quotes.",
    ]
    return Result(
        NAME, TITLE, SOURCE,
        setup={
            "V": V, "d": D, "N": N,
            "task": f"batches of N={N} positions with exactly {DISTINCT} distinct tokens, "
                    "random targets (as in gradient-table)",
            "model": f"probe model, V={V}, d={D}, res={RES:g}, s_in={S_IN:g}; variant "
                     f"{BROKEN} (input path dropped)",
            "init": f"E ~ N(0, {SIGMA:g}^2), W ~ N(0, 1/d), fresh per example",
            "optimizer": "none", "steps": 0,
            "trials": f"{trials} per k, k = {KS[0]}..{KS[-1]}, all drawn from seed {seed}",
        },
        rows=rows,
        series={"k": list(KS), "measured_pass": measured, "closed_form_with_replacement": repl,
                "closed_form_without_replacement": hyper, "row_complete_caught": caught,
                "trials": trials, "pool_seeds": example_seeds, "wrong_entries": wrong_counts},
        notes=notes, seeds=[seed], elapsed_s=time.perf_counter() - t0,
    )


def plot(result: Result, path: Path, plt: Any) -> Path:
    s = result.series
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(s["k"], s["closed_form_with_replacement"], "-", color="#1f77b4",
            label="closed form (56/64)^k")
    ax.plot(s["k"], s["closed_form_without_replacement"], "--", color="#1f77b4", alpha=0.6,
            label="closed form, without replacement")
    ax.plot(s["k"], s["measured_pass"], "o", ms=3.5, color="#d62728",
            label=f"measured, {s['trials']} trials per k")
    miss = 1 - s["row_complete_caught"] / s["trials"]
    ax.plot(s["k"], [miss] * len(s["k"]), "-", color="#2ca02c", lw=2.5,
            label="tyingspec row-complete check (passes it in 0 trials)")
    ax.set_xlabel("k = number of dE entries checked against central differences")
    ax.set_ylabel("P(check passes the output-path-only bug)")
    ax.set_title(f"Sampled gradient checks miss a dropped input path (V = {V}, {DISTINCT} tokens)")
    ax.set_ylim(-0.03, 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
