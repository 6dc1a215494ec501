"""`tyingspec reproduce`: exact claims asserted exactly, the rest smoke-tested at tiny sizes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tyingspec._src.core.finite import central_differences
from tyingspec._src.reproduce import EXPERIMENTS, configure_parser, run, run_experiment
from tyingspec._src.reproduce import _alignment as alignment
from tyingspec._src.reproduce import _blind_spot as blind_spot
from tyingspec._src.reproduce import _common as common
from tyingspec._src.reproduce import _gradient_table as gradient_table
from tyingspec._src.reproduce import _init_coupling as init_coupling
from tyingspec._src.reproduce import _loss_curves as loss_curves
from tyingspec._src.reproduce import _param_savings as param_savings
from tyingspec._src.reproduce import _repeat_bias as repeat_bias
from tyingspec._src.reproduce import _train as train

RTOL, ATOL = 1e-12, 1e-12


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    # Tiny matrices on 2 cores shared by xdist workers: threaded BLAS only adds contention.
    with common.single_threaded_blas():
        yield


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tyingspec reproduce")
    configure_parser(p)
    return p.parse_args(list(argv))


def verdict_of(result: common.Result, quantity: str) -> str:
    return result.row(quantity).verdict


# --- 1. gradient-table: exact ---------------------------------------------------------------

GT_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def gt_result() -> common.Result:
    return gradient_table.run(GT_SEEDS)


@pytest.mark.parametrize(("name", "wrong", "exact"), [
    ("tied", 0, 64), ("output-path-only", 8, 56), ("input-path-only", 64, 0)])
def test_gradient_table_row_counts_match_the_claims_exactly(
    gt_result: common.Result, name: str, wrong: int, exact: int
) -> None:
    for seed in GT_SEEDS:
        got = gt_result.series["per_seed"][str(seed)][name]
        assert (got["rows_wrong"], got["rows_exact"]) == (wrong, exact), f"seed={seed}"
        assert got["entries"] == 64 * 16, f"seed={seed}: every entry must be compared"
    assert verdict_of(gt_result, f"{name}: rows wrong") == common.HOLDS
    assert gt_result.row(f"{name}: rows wrong").measured_value == wrong


def test_gradient_table_output_path_only_is_wrong_exactly_on_the_batch_tokens(
    gt_result: common.Result,
) -> None:
    for seed in GT_SEEDS:
        got = gt_result.series["per_seed"][str(seed)]["output-path-only"]
        assert got["wrong_rows"] == gt_result.series["present_rows"][str(seed)], f"seed={seed}"
        assert got["diagnosis"] == "input_path_missing", f"seed={seed}"


def test_gradient_table_batch_has_exactly_eight_distinct_tokens() -> None:
    for seed in range(20):
        ex = gradient_table.make_example(seed)
        assert len(set(ex.tokens.tolist())) == 8, f"seed={seed}"
        assert ex.tokens.shape == (gradient_table.N,), f"seed={seed}"


def test_gradient_table_central_differences_agree_with_the_library_oracle() -> None:
    seed = 5
    ex = gradient_table.make_example(seed)
    mine = gradient_table.central_dE(ex)
    ref = central_differences(ex.E, ex.W, None, ex.tokens, ex.targets, gradient_table.RES,
                              gradient_table.S_IN).dE
    np.testing.assert_allclose(mine, ref, rtol=1e-7, atol=1e-9, err_msg=f"seed={seed}")


# --- 7. parameter-savings: exact ------------------------------------------------------------

@pytest.fixture(scope="module")
def ps_result() -> common.Result:
    return param_savings.run()


def test_gpt2_small_counts_and_share_are_exact(ps_result: common.Result) -> None:
    cfg = param_savings.GPT2_SMALL
    assert param_savings.total(cfg, tied=False) == 163_037_184
    assert param_savings.total(cfg, tied=True) == 124_439_808
    assert math.isclose(param_savings.share(cfg), 38_597_376 / 163_037_184, rel_tol=RTOL,
                        abs_tol=ATOL)
    assert round(100 * param_savings.share(cfg), 1) == 23.7
    assert verdict_of(ps_result, "GPT-2 small: GPT-2 small") == common.HOLDS
    assert verdict_of(ps_result, "GPT-2 small: exact counts") == common.HOLDS


@pytest.mark.parametrize(("cfg", "untied", "share_1dp", "verdict"), [
    (param_savings.TINYSTORIES_1M, 6_962_432, 46.2, common.FAILS),
    (param_savings.PYTHIA_14M, 14_067_712, 45.8, common.FAILS),
    (param_savings.NANOGPT_CHAR, 10_770_048, 0.2, common.FAILS),
    (param_savings.MINGPT_CHAR, 2_719_104, 0.5, common.HOLDS),
], ids=lambda v: getattr(v, "name", None))
def test_other_configs_are_counted_exactly_and_judged_honestly(
    ps_result: common.Result, cfg: param_savings.ArchConfig, untied: int, share_1dp: float,
    verdict: str,
) -> None:
    assert param_savings.total(cfg, tied=False) == untied
    assert round(100 * param_savings.share(cfg), 1) == share_1dp
    label = next(lab for lab, _, cfgs in param_savings.CLAIMS if cfg in cfgs)
    assert verdict_of(ps_result, f"{label}: {cfg.name}") == verdict


def test_tying_removes_exactly_vd_and_never_half() -> None:
    seed = 11
    rng = np.random.default_rng(seed)
    base = param_savings.GPT2_SMALL
    for _ in range(200):
        cfg = dataclasses.replace(
            base, vocab=int(rng.integers(2, 300_000)), d=int(rng.integers(1, 4096)),
            n_layer=int(rng.integers(0, 48)), n_positions=int(rng.integers(0, 8192)),
            linear_bias=bool(rng.integers(0, 2)), ln_bias=bool(rng.integers(0, 2)))
        removed = param_savings.total(cfg, tied=False) - param_savings.total(cfg, tied=True)
        assert removed == cfg.vocab * cfg.d, f"seed={seed} cfg={cfg}"
        assert param_savings.share(cfg) < 0.5, f"seed={seed} cfg={cfg}"


def test_halving_claim_is_shown_false(ps_result: common.Result) -> None:
    row = ps_result.row("'tying halves the parameters' is false")
    assert row.verdict == common.HOLDS
    assert row.measured_value < 0.5


def test_vocab_for_share_inverts_the_share() -> None:
    cfg = param_savings.NANOGPT_CHAR
    v = param_savings.vocab_for_share(cfg, 0.005)
    moved = dataclasses.replace(cfg, vocab=round(v))
    assert math.isclose(param_savings.share(moved), 0.005, rel_tol=1e-2, abs_tol=1e-5)


# --- 2. blind spot --------------------------------------------------------------------------

def test_closed_form_is_56_over_64_to_the_k() -> None:
    with_repl, without = blind_spot.closed_form(10, 128, 1024)
    assert math.isclose(with_repl, (56 / 64) ** 10, rel_tol=RTOL, abs_tol=ATOL)
    assert without < with_repl


def test_blind_spot_smoke_row_complete_check_catches_every_trial() -> None:
    seed, trials = 3, 60
    r = blind_spot.run((seed,), trials=trials, pool=2)
    assert r.series["row_complete_caught"] == trials, f"seed={seed}"
    assert r.row("row-complete check catches it").verdict == common.HOLDS, f"seed={seed}"
    p1 = r.series["measured_pass"][0]  # k = 1: pass iff the one entry is in a right row
    se = math.sqrt(7 / 8 * 1 / 8 / trials)
    assert abs(p1 - 7 / 8) <= 4 * se + 1e-12, f"seed={seed}: P(pass at k=1) = {p1}"
    assert len(r.series["measured_pass"]) == len(blind_spot.KS)


# --- 3. loss curves -------------------------------------------------------------------------

def test_loss_curves_smoke_broken_variant_ends_higher() -> None:
    seeds = (0, 1)
    r = loss_curves.run(seeds, quick=True)
    for s in seeds:
        curves = r.series["per_seed"][str(s)]
        assert curves["output-path-only"][-1] > curves["tied"][-1], f"seed={s}"
        assert curves["tied"][-1] < curves["tied"][0], f"seed={s}: correct model must learn"
    assert r.row("broken ends higher than correct").verdict == common.HOLDS
    for q in ("final loss, correct tied", "final loss, output path only"):
        assert r.row(q).claim and r.row(q).measured and r.row(q).verdict in (common.HOLDS,
                                                                             common.FAILS)


def test_roughness_of_a_straight_line_is_zero() -> None:
    assert math.isclose(loss_curves.roughness(list(np.linspace(3.0, 1.0, 50))), 0.0,
                        rel_tol=RTOL, abs_tol=1e-12)


def test_expected_loss_matches_the_library_loss_on_a_deterministic_task() -> None:
    seed = 4
    rng = np.random.default_rng(seed)
    task, perm = train.successor_task(rng, 16)
    model = train.init_model(rng, 16, 4, untied=False, sigma=0.5)
    from tyingspec._src.core.paths import loss_only

    ref = loss_only(model.E, model.E, model.W, None, np.arange(16), perm, model.res, model.s_in)
    assert math.isclose(train.expected_loss(model, task), ref, rel_tol=1e-12, abs_tol=1e-12), \
        f"seed={seed}"


# --- 4. repeat bias -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rb_result() -> common.Result:
    return repeat_bias.run((0, 1, 2), quick=True)


def test_repeat_bias_tied_res1_ranks_just_read_token_near_the_top(
    rb_result: common.Result,
) -> None:
    for s, per in rb_result.series["per_seed"].items():
        assert per["init"]["tied, res=1"] <= 3.0, f"seed={s}"


def test_repeat_bias_res0_and_untied_are_near_chance(rb_result: common.Result) -> None:
    chance = repeat_bias.CHANCE
    for label in ("tied, res=0", "untied"):
        vals = [per["init"][label] for per in rb_result.series["per_seed"].values()]
        assert abs(float(np.mean(vals)) - chance) <= 12.0, f"{label}: {vals}, seeds 0-2"
    assert rb_result.row("init: chance").verdict == common.HOLDS


def test_current_token_rank_counts_ties_as_chance() -> None:
    V = 10
    model = train.Model(np.zeros((V, 3)), np.zeros((3, 3)))
    np.testing.assert_allclose(train.current_token_rank(model, V), (V + 1) / 2, rtol=RTOL,
                               atol=ATOL)


def test_derangements_have_no_fixed_points() -> None:
    for seed in range(20):
        perm = train.derangement(np.random.default_rng(seed), 8)
        assert sorted(perm.tolist()) == list(range(8)), f"seed={seed}"
        assert not np.any(perm == np.arange(8)), f"seed={seed}"


# --- 5. aligned vs misaligned ---------------------------------------------------------------

def test_alignment_smoke_misaligned_task_favours_untied() -> None:
    seeds = (0, 1)
    r = alignment.run(seeds, quick=True)
    mis = np.asarray(r.series["ratios"]["misaligned"])
    ali = np.asarray(r.series["ratios"]["aligned"])
    assert np.all(mis > 1.0), f"seeds={seeds}: tied/untied ratios {mis}"
    assert float(mis.mean()) > float(ali.mean()), f"seeds={seeds}"
    assert r.row("misaligned: untied is better").verdict == common.HOLDS


def test_cluster_tasks_have_equal_entropy_and_are_relabellings() -> None:
    a = train.cluster_task(64, 8, aligned=True)
    m = train.cluster_task(64, 8, aligned=False)
    assert math.isclose(a.entropy, math.log(8), rel_tol=RTOL, abs_tol=ATOL)
    assert math.isclose(m.entropy, math.log(8), rel_tol=RTOL, abs_tol=ATOL)
    np.testing.assert_allclose(a.P.sum(axis=1), 1.0, rtol=RTOL, atol=ATOL)
    # Same multiset of rows up to a permutation of the columns (outputs).
    cols_a = sorted(tuple(np.flatnonzero(a.P[:, j])) for j in range(64))
    cols_m = sorted(tuple(np.flatnonzero(m.P[:, j])) for j in range(64))
    assert cols_a == cols_m


# --- 6. init coupling -----------------------------------------------------------------------

def test_init_coupling_smoke_doubling_factors() -> None:
    seeds = (0, 1)
    r = init_coupling.run(seeds, quick=True)
    f = r.series["fine"]
    np.testing.assert_allclose(f["factor_x"], 2.0, rtol=1e-12, atol=1e-12,
                               err_msg=f"seeds={seeds}")
    # tanh saturation pulls the stream's factor below 2 and the logits' below 4 (where the
    # bounded tanh term stops mattering, both return to 2 and 4 up to a small cross term).
    fh = np.asarray(f["factor_h"])
    fl = np.asarray(f["factor_logits"])
    assert np.all((fh > 1.7) & (fh < 2.01)), f"seeds={seeds}: {fh.min()}-{fh.max()}"
    assert np.all((fl > 3.5) & (fl < 4.02)), f"seeds={seeds}: {fl.min()}-{fl.max()}"
    assert fh.min() < 1.95 and fl.min() < 3.9, f"seeds={seeds}: saturation must show"
    assert r.row("doubling sigma: residual stream x (entering the block)").verdict == \
        common.HOLDS


# --- CLI ------------------------------------------------------------------------------------

SETUP_KEYS = {"task", "V", "d", "N", "init", "optimizer", "steps"}


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_cli_writes_json_with_setup_claim_measured_and_verdict(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse(name, "--quick", "--seeds", "2", "--out", str(tmp_path),
                     "--no-progress")) == 0
    out = capsys.readouterr().out
    assert "quantity" in out and "claim" in out and "verdict" in out
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["experiment"] == name
    assert SETUP_KEYS <= set(data["setup"]), set(data["setup"])
    assert data["rows"], "an experiment must report at least one row"
    for row in data["rows"]:
        assert {"quantity", "claim", "measured", "verdict", "reason"} <= set(row)
        assert row["verdict"] in (common.HOLDS, common.FAILS, common.NOT_JUDGED)
    assert any(r["verdict"] != common.NOT_JUDGED for r in data["rows"])
    # Counting needs no seed; the blind-spot trials all draw from the first seed.
    expected = {"parameter-savings": [], "blind-spot": [0]}.get(name, [0, 1])
    assert data["seeds"] == expected
    png = tmp_path / f"{name}.png"
    if importlib.util.find_spec("matplotlib") is None:
        # Without the [plot] extra the PNG is skipped on purpose and the JSON still written.
        assert not png.exists()
    else:
        assert png.stat().st_size > 0


def test_cli_without_matplotlib_still_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(common, "_MPL_WARNED", False)
    assert run(parse("parameter-savings", "--out", str(tmp_path))) == 0
    assert (tmp_path / "parameter-savings.json").exists()
    assert not (tmp_path / "parameter-savings.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [(), ("gradient-table", "--all")])
def test_cli_usage_errors_exit_2(argv: tuple[str, ...],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(*argv)) == 2
    assert "NAME or --all" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "seeds"), [("3", (0, 1, 2)), ("4,9", (4, 9)), ("7,", (7,))])
def test_seeds_option_takes_a_count_or_a_list(text: str, seeds: tuple[int, ...]) -> None:
    assert parse("gradient-table", "--seeds", text).seeds == seeds


@pytest.mark.parametrize("text", ["0", "-1", "x", ",", "1,-2"])
def test_seeds_option_rejects_nonsense(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("gradient-table", "--seeds", text)


def test_run_experiment_honours_explicit_seeds() -> None:
    r = run_experiment("gradient-table", seeds=[7])
    assert r.seeds == [7]


def test_progress_bar_waits_for_its_delay_and_then_reports() -> None:
    quiet = io.StringIO()
    bar = common.Progress("x", 10, stream=quiet, delay=3600.0)
    for _ in range(9):
        bar.advance()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    bar = common.Progress("x", 4, stream=loud, delay=0.0)
    for _ in range(4):
        bar.advance()
    bar.close()
    assert "4/4" in loud.getvalue()


def test_jsonable_converts_numpy_and_drops_nan() -> None:
    got: Any = common.jsonable({"a": np.float64(1.5), "b": np.arange(3), "c": float("nan"),
                                "d": np.bool_(True)})
    assert got == {"a": 1.5, "b": [0, 1, 2], "c": None, "d": True}
    json.dumps(got, allow_nan=False)
