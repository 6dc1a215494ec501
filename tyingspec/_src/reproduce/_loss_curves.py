"""Experiment 3: training curves of the correct tied model and the output-path-only variant."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tyingspec._src.reproduce._common import (
    NOT_JUDGED,
    Progress,
    ProgressFactory,
    Result,
    Row,
    direction_row,
    figure_row,
    save_figure,
    silent_progress,
    spread_text,
)
from tyingspec._src.reproduce._train import Recipe, init_model, markov_task, train

NAME = "loss-curves"
TITLE = "the output-path-only variant trains smoothly but ends higher"
SOURCE = "write-up: final loss 1.84 (output path only) vs 1.61 (correct); curve smooth, kink-free"

V, D, SUCCESSORS = 64, 16, 5
RES, S_IN = 1.0, 1.0
RECIPE = Recipe(steps=600, batch=256, lr=1e-2)
QUICK = Recipe(steps=80, batch=128, lr=1e-2)
SENSITIVITY_D = (16, 32, 64)
CLAIM_CORRECT, CLAIM_BROKEN = 1.61, 1.84
ROUGHNESS_FACTOR = 2.0
EVERY = 5


def roughness(curve: Sequence[float], skip: float = 0.1) -> float:
    """Largest |second difference| of a curve after its first ``skip`` share (the descent)."""
    c = np.asarray(curve, dtype=np.float64)
    c = c[int(skip * c.size):]
    return float(np.max(np.abs(np.diff(c, 2)))) if c.size > 2 else 0.0


def train_pair(seed: int, d: int, recipe: Recipe, progress_bar: Progress | None = None
               ) -> dict[str, dict[str, Any]]:
    """Both variants from the same task, initial weights and batch stream (common numbers)."""
    out = {}
    for kind in ("tied", "output-path-only"):
        rng = np.random.default_rng(seed)
        task = markov_task(rng, V, SUCCESSORS)
        model = init_model(rng, V, d, untied=False, sigma=1.0 / np.sqrt(d), res=RES, s_in=S_IN)
        out[kind] = train(kind, model, task, recipe, rng, every=EVERY,
                          progress=progress_bar)
    return out


def run(seeds: Sequence[int] = (0, 1, 2), *, quick: bool = False,
        progress: ProgressFactory = silent_progress, recipe: Recipe | None = None,
        sensitivity: bool | None = None) -> Result:
    """Train both variants per seed; optionally repeat at larger d to show what moves the gap."""
    t0 = time.perf_counter()
    recipe = recipe or (QUICK if quick else RECIPE)
    sensitivity = (not quick) if sensitivity is None else sensitivity
    entropy = markov_task(np.random.default_rng(seeds[0]), V, SUCCESSORS).entropy
    dims = [d for d in SENSITIVITY_D if d != D] if sensitivity else []
    total = recipe.steps * 2 * (len(seeds) + len(dims))
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    sens: dict[int, dict[str, float]] = {}
    with progress("training", total) as bar:
        for seed in seeds:
            runs[seed] = train_pair(seed, D, recipe, bar)
        for d in dims:
            pair = train_pair(seeds[0], d, recipe, bar)
            sens[d] = {k: v["eval_loss"][-1] for k, v in pair.items()}
    final_c = np.array([runs[s]["tied"]["eval_loss"][-1] for s in seeds])
    final_b = np.array([runs[s]["output-path-only"]["eval_loss"][-1] for s in seeds])
    best_b = np.array([min(runs[s]["output-path-only"]["eval_loss"]) for s in seeds])
    rough_c = np.array([roughness(runs[s]["tied"]["eval_loss"]) for s in seeds])
    rough_b = np.array([roughness(runs[s]["output-path-only"]["eval_loss"]) for s in seeds])
    sens[D] = {"tied": float(final_c[0]), "output-path-only": float(final_b[0])}
    sens_text = "; ".join(f"d={d}: {sens[d]['tied']:.2f} vs {sens[d]['output-path-only']:.2f}"
                          for d in sorted(sens))
    why = (f"the write-up's task is not given; here the floor is ln {SUCCESSORS} = "
           f"{entropy:.3f} and the final loss depends on d and steps (see notes)")
    rows: list[Row] = [
        figure_row("final loss, correct tied", CLAIM_CORRECT, float(final_c.mean()), decimals=2,
                   spread=spread_text(final_c, 3), why_not=why),
        figure_row("final loss, output path only", CLAIM_BROKEN, float(final_b.mean()),
                   decimals=2, spread=spread_text(final_b, 3), why_not=why),
        direction_row("broken ends higher than correct", "yes (gap 0.23)",
                      f"gap {float((final_b - final_c).mean()):+.3f} "
                      f"({int((final_b > final_c).sum())} of {len(seeds)} seeds higher)",
                      bool(np.all(final_b > final_c)), "higher in every seed",
                      "not higher in every seed", claim_value=CLAIM_BROKEN - CLAIM_CORRECT,
                      measured_value=float((final_b - final_c).mean())),
        direction_row("broken curve smooth, kink-free", "yes",
                      f"max |2nd diff| {rough_b.max():.4f} vs correct {rough_c.max():.4f}",
                      bool(rough_b.max() <= ROUGHNESS_FACTOR * max(rough_c.max(), 1e-12)),
                      f"no rougher than {ROUGHNESS_FACTOR:g}x the correct curve: nothing in the "
                      "curve flags the bug",
                      "the broken curve has jumps the correct one lacks",
                      measured_value=float(rough_b.max())),
        Row("broken: lowest loss on the way", "(no claim)",
            f"{best_b.mean():.3f} at its best, then {final_b.mean():.3f}", NOT_JUDGED,
            "without the input path dE is not the gradient of the loss, so Adam can drift "
            "upward after a minimum without any visible kink", None, float(best_b.mean())),
    ]
    notes = [
        "Loss is the exact expected cross-entropy over all V inputs against the true "
        f"next-token distribution (floor = task entropy {entropy:.3f}), evaluated every "
        f"{EVERY} steps; both variants see the same task, initial weights and batches.",
        f"Which setting changes the figures: final loss, correct vs broken, at {recipe.steps} "
        f"steps: {sens_text}. The input path matters less as d grows (random input "
        "embeddings are already nearly orthogonal), so the gap shrinks.",
        f"The claimed 1.61 equals ln 5 = {np.log(5):.3f}, the entropy of a 5-successor task; "
        "that is why 5 successors were chosen (a guess at the write-up's task, stated so).",
    ]
    series = {
        "steps": runs[seeds[0]]["tied"]["steps"],
        "per_seed": {str(s): {k: v["eval_loss"] for k, v in runs[s].items()} for s in seeds},
        "batch_loss_seed0": {k: v["batch_loss"] for k, v in runs[seeds[0]].items()},
        "entropy": entropy,
        "final_by_d": {str(d): sens[d] for d in sorted(sens)},
    }
    return Result(
        NAME, TITLE, SOURCE,
        setup={
            "V": V, "d": D, "N": f"{recipe.batch} pairs per step",
            "task": markov_task(np.random.default_rng(seeds[0]), V, SUCCESSORS).description
            + "; the table is redrawn per seed",
            "model": f"probe model, V={V}, d={D}, res={RES:g}, s_in={S_IN:g}, tied, no bias; "
                     "correct = built-in 'tied', broken = built-in 'output-path-only'",
            "init": "E ~ N(0, 1/d), W ~ N(0, 1/d)",
            "optimizer": recipe.describe(),
            "steps": recipe.steps,
        },
        rows=rows, series=series, notes=notes, seeds=list(seeds),
        elapsed_s=time.perf_counter() - t0,
    )


def plot(result: Result, path: Path, plt: Any) -> Path:
    s = result.series
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"tied": "#1f77b4", "output-path-only": "#d62728"}
    labels = {"tied": "correct tied", "output-path-only": "output path only (input path dropped)"}
    for i, curves in enumerate(s["per_seed"].values()):
        for kind, curve in curves.items():
            ax.plot(s["steps"], curve, color=colors[kind], alpha=1.0 if i == 0 else 0.35,
                    lw=1.6 if i == 0 else 1.0,
                    label=f"{labels[kind]}" if i == 0 else None)
    ax.axhline(s["entropy"], color="gray", ls=":", label=f"task entropy {s['entropy']:.3f}")
    ax.axhline(1.61, color="#1f77b4", ls="--", lw=0.8, alpha=0.6, label="claimed 1.61 / 1.84")
    ax.axhline(1.84, color="#d62728", ls="--", lw=0.8, alpha=0.6)
    ax.set_xlabel("training step")
    ax.set_ylabel("expected next-token loss (nats)")
    ax.set_ylim(s["entropy"] - 0.2, None)
    ax.set_title(f"Loss curves, V = {V}, d = {D} (seeds {', '.join(s['per_seed'])}; faint = "
                 "other seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
