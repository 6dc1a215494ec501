"""Experiment 7: the parameters tying saves, counted from architecture configs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tyingspec._src.reproduce._common import (
    ProgressFactory,
    Result,
    Row,
    direction_row,
    fmt_int,
    save_figure,
    silent_progress,
)

NAME = "parameter-savings"
TITLE = "tying removes exactly V*d parameters: the share of the untied total"
SOURCE = ("write-up: GPT-2 small 23.7%, a large-vocabulary toy 45.3%, a character-level model "
          "0.5%; 'tying halves the parameters' is false")


@dataclass(frozen=True)
class ArchConfig:
    """A decoder-only transformer as its config states it, plus how its layers carry biases."""

    name: str
    source: str
    vocab: int
    d: int
    n_layer: int
    n_head: int
    n_positions: int  # learned position table rows; 0 for rotary (no parameters)
    mlp_hidden: int = 0  # 0 means 4 * d
    linear_bias: bool = True  # biases on attention and MLP projections
    qkv_bias: bool = True  # GPT-Neo drops the q/k/v biases only
    ln_bias: bool = True

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 4 * self.d


def count(cfg: ArchConfig, *, tied: bool) -> dict[str, int]:
    """Every parameter by component; the untied model adds an output matrix V x d, no bias."""
    d, hid = cfg.d, cfg.hidden
    ln = d * (2 if cfg.ln_bias else 1)
    lb = 1 if cfg.linear_bias else 0
    qb = 1 if (cfg.linear_bias and cfg.qkv_bias) else 0
    block = (
        ln  # ln_1
        + 3 * d * d + qb * 3 * d  # q, k, v (GPT-2's fused c_attn)
        + d * d + lb * d  # attention output projection
        + ln  # ln_2
        + d * hid + lb * hid  # mlp up
        + hid * d + lb * d  # mlp down
    )
    parts = {
        "token embedding (V*d)": cfg.vocab * d,
        "position embedding": cfg.n_positions * d,
        f"{cfg.n_layer} blocks": cfg.n_layer * block,
        "final layer norm": ln,
    }
    if not tied:
        parts["output matrix (V*d, untied)"] = cfg.vocab * d
    return parts


def total(cfg: ArchConfig, *, tied: bool) -> int:
    return sum(count(cfg, tied=tied).values())


def share(cfg: ArchConfig) -> float:
    """Share of the untied total that tying removes."""
    untied = total(cfg, tied=False)
    return (untied - total(cfg, tied=True)) / untied


def vocab_for_share(cfg: ArchConfig, target: float) -> float:
    """The vocabulary size at which this body would give ``target`` (share is increasing in V)."""
    rest = total(cfg, tied=True) - cfg.vocab * cfg.d  # everything but the token embedding
    # s = V d / (2 V d + rest)  =>  V = s * rest / (d * (1 - 2 s))
    return target * rest / (cfg.d * (1 - 2 * target))


GPT2_SMALL = ArchConfig("GPT-2 small", "HF gpt2 config: vocab 50257, n_embd 768, n_layer 12, "
                        "n_head 12, n_positions 1024; biases everywhere", 50257, 768, 12, 12,
                        1024)
TINYSTORIES_1M = ArchConfig(
    "TinyStories-1M", "GPT-Neo layout (no q/k/v bias): vocab 50257, hidden 64, 8 layers, "
    "16 heads, 2048 positions", 50257, 64, 8, 16, 2048, qkv_bias=False)
PYTHIA_14M = ArchConfig(
    "Pythia-14m (tied)", "GPT-NeoX layout, rotary (no position table): vocab 50304, hidden "
    "128, 6 layers, 4 heads; shipped untied, counted here both ways", 50304, 128, 6, 4, 0)
NANOGPT_CHAR = ArchConfig(
    "nanoGPT shakespeare-char", "nanoGPT config/train_shakespeare_char.py: vocab 65, n_embd "
    "384, n_layer 6, n_head 6, block 256, bias=False", 65, 384, 6, 6, 256, linear_bias=False,
    ln_bias=False)
MINGPT_CHAR = ArchConfig(
    "minGPT chargpt (gpt-mini)", "minGPT projects/chargpt: vocab 65 (tiny shakespeare), "
    "gpt-mini = n_layer 6, n_head 6, n_embd 192, block 128; biases everywhere", 65, 192, 6, 6,
    128)

#: (claim label, claimed share or None, configs compared with it)
CLAIMS: list[tuple[str, float, list[ArchConfig]]] = [
    ("GPT-2 small", 0.237, [GPT2_SMALL]),
    ("large-vocabulary toy", 0.453, [TINYSTORIES_1M, PYTHIA_14M]),
    ("character-level model", 0.005, [NANOGPT_CHAR, MINGPT_CHAR]),
]
GPT2_UNTIED, GPT2_TIED = 163_037_184, 124_439_808


def run(seeds: Sequence[int] = (), *, quick: bool = False,
        progress: ProgressFactory = silent_progress) -> Result:
    """Deterministic counting; ``seeds`` and ``quick`` are accepted for a uniform interface."""
    t0 = time.perf_counter()
    rows: list[Row] = []
    configs: dict[str, dict[str, object]] = {}
    for label, claim, cfgs in CLAIMS:
        for cfg in cfgs:
            tied, untied = total(cfg, tied=True), total(cfg, tied=False)
            s = share(cfg)
            configs[cfg.name] = {"config": asdict(cfg), "tied": tied, "untied": untied,
                                 "removed": untied - tied, "share": s,
                                 "parts_untied": count(cfg, tied=False)}
            ok = round(100 * s, 1) == round(100 * claim, 1)
            v_need = vocab_for_share(cfg, claim)
            rows.append(direction_row(
                f"{label}: {cfg.name}", f"{100 * claim:.1f}%",
                f"{100 * s:.1f}% ({100 * s:.3f}%: {fmt_int(untied - tied)} of {fmt_int(untied)})",
                ok, "equal at the claim's 1-decimal precision",
                f"this body would need V = {v_need:,.0f} (it has {cfg.vocab:,}) or a "
                f"non-embedding share of {100 * (1 - 2 * claim):.1f}% of the untied total "
                f"(it has {100 * (1 - 2 * s):.1f}%); the write-up does not name its config",
                claim_value=claim, measured_value=s))
    g_t, g_u = total(GPT2_SMALL, tied=True), total(GPT2_SMALL, tied=False)
    rows.append(direction_row(
        "GPT-2 small: exact counts", f"untied {fmt_int(GPT2_UNTIED)}, tied {fmt_int(GPT2_TIED)}",
        f"untied {fmt_int(g_u)}, tied {fmt_int(g_t)}", (g_u, g_t) == (GPT2_UNTIED, GPT2_TIED),
        "counted component by component from the config", "counts differ",
        claim_value=[GPT2_UNTIED, GPT2_TIED], measured_value=[g_u, g_t]))
    all_cfgs = [c for _, _, cs in CLAIMS for c in cs]
    exact = all(total(c, tied=False) - total(c, tied=True) == c.vocab * c.d for c in all_cfgs)
    rows.append(direction_row("removed = V*d exactly", "yes", "yes" if exact else "no", exact,
                              f"in all {len(all_cfgs)} configs", "some config differs"))
    biggest = max(all_cfgs, key=share)
    rows.append(direction_row(
        "'tying halves the parameters' is false", "yes",
        f"largest share {100 * share(biggest):.1f}% ({biggest.name}); "
        f"GPT-2 small {100 * share(GPT2_SMALL):.1f}%",
        all(share(c) < 0.5 for c in all_cfgs),
        "untied = 2*V*d + rest, so the share V*d/(2*V*d + rest) is below 50% whenever "
        "the model has any other parameter",
        "some config reaches 50%", claim_value=0.5, measured_value=share(biggest)))
    notes = [f"{c.name}: {c.source}" for c in all_cfgs]
    notes.append("Counts: q/k/v and output projections, MLP up (d x 4d) and down, two layer "
                 "norms per block and a final one, token and position tables; the untied model "
                 "adds an output matrix V x d without bias (as GPT-2's lm_head).")
    return Result(
        NAME, TITLE, SOURCE,
        setup={"V": "per config", "d": "per config", "N": "n/a", "task": "none (counting)",
               "model": "configs below, counted component by component", "init": "n/a",
               "optimizer": "n/a", "steps": 0},
        rows=rows, series={"configs": configs}, notes=notes, seeds=[],
        elapsed_s=time.perf_counter() - t0,
    )


def plot(result: Result, path: Path, plt: Any) -> Path:
    configs = result.series["configs"]
    claims = {c.name: claim for _, claim, cs in CLAIMS for c in cs}
    names = list(configs)
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.5))
    shares = [100 * configs[n]["share"] for n in names]
    ax.barh(range(len(names)), shares, color="#6baed6")
    for i, n in enumerate(names):
        ax.plot([100 * claims[n]] * 2, [i - 0.4, i + 0.4], color="#d62728", lw=2)
        ax.text(shares[i] + 0.8, i, f"{shares[i]:.2f}%", va="center", fontsize=8)
    ax.axvline(50, color="k", ls="--", lw=1)
    ax.text(50.5, len(names) - 0.6, "'halves'", fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlim(0, 60)
    ax.set_xlabel("share of the untied parameter count removed by tying (%); red = claim")
    ax.set_title("Tying removes exactly V*d parameters", fontsize=10)
    return save_figure(fig, path)
