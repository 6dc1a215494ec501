"""The linear-ce kind on what shipped: labels for released fused-CE bugs, the options a
constructor really takes, every option in every dtype, the precision a kernel computed in,
``--shape`` keeping each case's power, the long case fitted to the kernel, ``--device``.

The kernels are in ``tests/linear_ce_shipped_targets.py`` (each the zoo's correct code with
one released slip); the released Triton kernels themselves run in the slow tier
(``tests/kinds/linear_ce/test_triton_kernels.py``).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tyingspec._src.core.cases import at_shape
from tyingspec._src.front.check import CheckReport, check_target
from tyingspec._src.front.results import EXIT_NO_POWER
from tyingspec._src.kinds.linear_ce import kind
from tyingspec._src.kinds.linear_ce.adapter import supported
from tyingspec._src.kinds.linear_ce.spec import SPEC
from tyingspec._src.kinds.linear_ce.zoo import LINEAR_CE_BUILTINS

HERE = str(Path(__file__).parents[2])
CASES = {c.name: c for c in kind.standard_ce_cases(0)}


def run(spec: str, *names: str) -> CheckReport:
    cases = [CASES[n] for n in names] if names else list(CASES.values())
    return check_target(f"linear_ce_shipped_targets:{spec}", "linear-ce", 0, cases,
                        paths=(HERE,), shrink_budget=0)


def by_case(report: CheckReport) -> dict[str, tuple[str, str]]:
    return {r.case.name: (r.status, "" if r.diagnosis is None else
                          f"{r.diagnosis.label}: {r.diagnosis.detail}")
            for r in report.results}


def test_an_option_taken_and_ignored_is_named_with_the_option() -> None:
    got = by_case(run("ignores_smoothing", "ce-label-smoothing", "ce-plain"))
    assert got["ce-plain"][0] == "correct"
    status, text = got["ce-label-smoothing"]
    assert status == "wrong" and text.startswith("option_ignored")
    assert "label_smoothing=0.1 was accepted and ignored" in text


def test_a_none_reduction_that_sums_is_a_forward_mismatch_naming_the_shapes() -> None:
    report = run("none_sums", "ce-none", "ce-sum")
    got = by_case(report)
    assert got["ce-sum"][0] == "correct"
    status, text = got["ce-none"]
    assert status == "wrong" and text.startswith("forward_mismatch"), text
    assert "shape ()" in text and "shape (23,)" in text and "the sum of the per-token" in text
    assert report.exit_code == 1  # a wrong forward, not an adapter error (exit 2)


def test_padded_lanes_in_the_logsumexp_are_named_with_the_lanes() -> None:
    got = by_case(run("padded_lanes", "ce-softcap", "ce-plain"))
    assert got["ce-plain"][0] == "correct"  # without a softcap a -inf lane adds nothing
    status, text = got["ce-softcap"]
    assert status == "wrong" and text.startswith("padded_lanes_in_lse"), text
    assert "27 more logits of -2" in text and "lanes 37..63" in text


@pytest.mark.slow
@pytest.mark.moved
def test_a_kwargs_constructor_is_asked_what_it_takes() -> None:
    """nn.CrossEntropyLoss behind ``**kwargs`` refuses softcap and the rest: those cases are
    left out, not run into a TypeError (exit 2)."""
    from linear_ce_shipped_targets import KwargsLinearCE  # type: ignore[import-not-found]

    took = supported(KwargsLinearCE)
    assert {"ignore_index", "label_smoothing", "reduction=none"} <= set(took)
    assert not {"softcap", "lse_square_scale", "logit_scale", "ce_weight"} & set(took)
    names = ("ce-plain", "ce-softcap", "ce-label-smoothing", "ce-none", "ce-ignored")
    report = check_target("linear_ce_shipped_targets:KwargsLinearCE", "linear-ce", 0,
                          [CASES[n] for n in names], paths=(HERE,))
    assert report.exit_code == 0, report.diagnosis
    assert any("left out ce-softcap" in n for n in report.notes)


def test_a_reduction_asserted_to_mean_or_sum_leaves_none_out() -> None:
    from linear_ce_shipped_targets import MeanSumOnly

    assert "reduction=none" not in supported(MeanSumOnly)
    assert "reduction=sum" in supported(MeanSumOnly)
    report = check_target("linear_ce_shipped_targets:MeanSumOnly", "linear-ce", 0,
                          [CASES[n] for n in ("ce-plain", "ce-sum", "ce-none")], paths=(HERE,))
    assert report.exit_code == 0, report.diagnosis
    assert any(n.startswith("left out ce-none") for n in report.notes)


@pytest.mark.slow
@pytest.mark.moved
def test_every_option_runs_in_every_low_precision() -> None:
    """Each option's case again in bfloat16 and float16: a kernel whose half-precision branch
    drops the logit scale is caught there (the old option-free bfloat16 case passed it)."""
    for name in kind.OPTION_CASES:
        for dtype in kind.LOW_DTYPES:
            twin = CASES[f"{name}-{dtype}"]
            assert twin.dtype == dtype
            assert twin.N == kind.LOW_SHAPES.get(name, {}).get("N", CASES[name].N)
            assert set(kind.ce_options(twin.ce)) == set(kind.ce_options(CASES[name].ce))
    got = by_case(run("half_drops_scale", "ce-logit-scale", "ce-logit-scale-bfloat16",
                      "ce-logit-scale-float16"))
    assert got["ce-logit-scale"][0] == "correct"
    for dtype in kind.LOW_DTYPES:
        status, text = got[f"ce-logit-scale-{dtype}"]
        assert status == "wrong" and text.startswith("logit_scale_dropped"), (dtype, text)


def test_a_low_precision_case_blind_to_a_known_bug_says_so() -> None:
    """The float64 softcap case judged at bfloat16 (``--precision bfloat16``): at V = 37 and
    softcap 2 padded lanes shift the lse by 0.04, inside the lse bound as well as the rows',
    so the correct kernel is no_power there, naming the bug, never a plain pass."""
    report = check_target("ce-torch", "linear-ce", 0, [CASES["ce-softcap"]],
                          precision="bfloat16")
    status, text = by_case(report)["ce-softcap"]
    assert status == "no_power" and "padded_lanes_in_lse" in text, text
    assert report.exit_code == EXIT_NO_POWER  # never a pass


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("dtype", kind.LOW_DTYPES)
def test_padded_lanes_are_caught_in_each_low_precision_and_a_correct_kernel_has_power(
        dtype: str) -> None:
    """The softcap's low-precision cases, at a vocabulary, softcap and logit spread where the
    padded lanes' shift of every token's lse is several times the lse bound: the correct
    kernel is correct there (not no_power), and a kernel with the lanes in its logsumexp, in
    that dtype, is named, with its lanes."""
    case = CASES[f"ce-softcap-{dtype}"]
    correct = check_target("ce-torch", "linear-ce", 0, [case], shrink_budget=0)
    assert correct.results[0].status == "correct", by_case(correct)
    padded = run("padded_lanes_torch", case.name)
    status, text = by_case(padded)[case.name]
    assert status == "wrong" and text.startswith("padded_lanes_in_lse"), text
    assert "7 more logits of -0.15" in text and "lanes 9..15" in text, text
    assert padded.exit_code == 1


def test_the_lse_bound_holds_a_correct_kernel_and_tells_the_lanes() -> None:
    """The lse bound on the bfloat16 softcap case: the correct loss inside it, the padded
    lanes' more than twice it away; at the float64 case's V = 37, softcap 2, it cannot."""
    from tyingspec import build
    from tyingspec._src.kinds.linear_ce.reference import linear_ce

    for name, tells in (("ce-softcap-bfloat16", True), ("ce-softcap", False)):
        batch = build(CASES[name])
        args = (kind.inputs(batch)["h"], batch.E, batch.targets, batch.b,
                kind.options_of(batch), batch.grad_output)
        bound = kind.lse_bound(args, "bfloat16")
        assert bound is not None
        ref = linear_ce(*args, dtype="float64")
        V = batch.E.shape[0]
        lanes = (1 << max(4, (V - 1).bit_length())) - V
        padded = linear_ce(*args, dtype="float64", lanes=(lanes, -args[4].softcap))
        shift = abs(float(padded.loss) - float(ref.loss))
        assert shift > 0
        assert kind._lse_tells(padded, ref, bound) is tells, (name, shift, float(bound))


def test_the_low_precision_option_cases_have_power_where_a_value_restores_it() -> None:
    """At label_smoothing=0.1, a z-loss of 0.05 and 60% ignored, a correct kernel's bfloat16
    cases were no_power (the misweighting, the missing z-loss, a mean counting the ignored
    tokens all inside the bound); at the low-precision cases' own values they decide."""
    names = [f"{n}-{dt}" for n in ("ce-label-smoothing", "ce-z-loss", "ce-ignore-index")
             for dt in kind.LOW_DTYPES]
    got = by_case(check_target("ce-torch", "linear-ce", 0, [CASES[n] for n in names],
                               shrink_budget=0))
    assert {n: s for n, (s, _) in got.items()} == dict.fromkeys(names, "correct"), got


def test_a_kernel_computing_in_float32_is_judged_there_and_the_report_says_so() -> None:
    report = run("Float32Inside", "ce-plain", "ce-ignored", "ce-one-target")
    assert report.exit_code == 0, report.diagnosis
    for r in report.results:
        assert r.precision == "float32" and "float32" in r.precision_note, r.precision_note
    assert "every value it returned is a float32" in " ".join(report.diagnosis.split())


@pytest.mark.parametrize("name", ["ce-overflow", "ce-softcap-derivative-missing",
                                  "ce-block-overwritten", "ce-numpy"])
def test_the_builtins_that_lost_power_under_shape_keep_their_verdict(name: str) -> None:
    """ce-overflow exited 0 under --shape 37,6,23 (logits near 0, no overflow), and ce-long
    took N of the shape (ce-block-overwritten is wrong only past 1024 tokens)."""
    b = LINEAR_CE_BUILTINS[name]
    exposing = {"ce-overflow": "ce-large-logits", "ce-softcap-derivative-missing": "ce-softcap",
                "ce-block-overwritten": "ce-long", "ce-numpy": "ce-large-logits"}[name]
    cases, _ = at_shape([CASES[exposing]], 37, 6, 23, SPEC)
    report = check_target(name, "linear-ce", 0, cases, shrink_budget=0)
    assert report.exit_code == (0 if b.breaks is None else 1), report.diagnosis
    assert report.diagnosis_label == ("correct" if b.breaks is None else b.expected)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(37, 6, 23), (64, 16, 40)])
def test_every_builtin_keeps_its_verdict_under_shape(shape: tuple[int, int, int]) -> None:
    """--shape draws each case for the logits it names (ce-large-logits' 1e4 at any width),
    keeps ce-long's length: ce-overflow exited 0 under --shape 37,6,23 when every case took
    GPT-2's e_scale of 0.02."""
    cases, _ = at_shape(list(CASES.values()), *shape, SPEC)
    for name, b in LINEAR_CE_BUILTINS.items():
        report = check_target(name, "linear-ce", 0, cases, shrink_budget=0)
        if b.breaks is None:
            assert report.exit_code == 0, (name, report.diagnosis)
        else:
            assert report.exit_code == 1, (name, report.diagnosis)
            assert report.diagnosis_label == b.expected, (name, report.diagnosis_label)


def test_shape_draws_each_case_for_its_logits_and_keeps_the_long_case_long() -> None:
    cases, _ = at_shape(list(CASES.values()), 50, 768, 64, SPEC)
    by = {c.name: c for c in cases}
    large = by["ce-large-logits"]
    assert large.d * large.e_scale ** 2 == pytest.approx(1e4)
    assert by["ce-long"].N == kind.LONG_N and by["ce-plain"].N == 64


def test_the_long_case_spans_two_of_the_kernels_own_blocks() -> None:
    cases = list(CASES.values())
    plain, _ = kind.shape_ce_cases("k", {"interpreted": None}, cases)
    assert plain == cases  # a compiled or numpy kernel keeps 8101 tokens
    fitted, notes = kind.shape_ce_cases("k", {"interpreted": "3.9.0", "block_seen": 16}, cases)
    long = next(c for c in fitted if c.name == "ce-long")
    assert 128 < long.N < kind.LONG_N and long.N % kind.CHUNK and long.N % 16
    assert any("triton 3.9.0" in n for n in notes)
    wide, _ = kind.shape_ce_cases("k", {"interpreted": "3.9.0", "block_seen": 512}, cases)
    assert 512 < next(c for c in wide if c.name == "ce-long").N
    declared, notes = kind.shape_ce_cases("k", {"block_declared": 2048}, cases)
    assert next(c for c in declared if c.name == "ce-long").N > 2048
    assert any("tyingspec_block = 2048" in n for n in notes)


def test_device_cuda_without_a_gpu_is_an_adapter_error_naming_it() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: "
                    "tests/kinds/linear_ce/test_linear_ce_shipped.py's GPU tests run")
    case = CASES["ce-plain"].with_setting("device", "cuda")
    report = check_target("ce-torch", "linear-ce", 0, [case])
    assert report.exit_code == 2
    assert "--device cuda: torch sees no CUDA device here" in (report.results[0].error or "")
    import tyingspec

    api = tyingspec.check("ce-torch", "linear-ce", case="ce-plain", device="cuda")
    assert api.exit_code == 2 and api.verdict == "adapter_error"
    with pytest.raises(ValueError, match="--device tpu: expected one of cpu, cuda"):
        tyingspec.check("ce-torch", "linear-ce", case="ce-plain", device="tpu")


def test_device_cuda_leaves_a_numpy_kernel_out() -> None:
    case = CASES["ce-plain"].with_setting("device", "cuda")
    assert "device=cuda" in kind.needed_options(case)
    assert kind.needed_options(replace(case, setting="")) == set()


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device; CI here has none and checks "
                    "Triton kernels under the Triton interpreter instead")
def test_device_cuda_runs_the_torch_kernel_on_the_gpu_with_the_same_verdicts() -> None:
    for name in ("ce-torch", "ce-torch-scale-dropped", "ce-grad-output-first"):
        cpu = check_target(name, "linear-ce", 0, list(CASES.values()), shrink_budget=0)
        gpu = check_target(name, "linear-ce", 0, [c.with_setting("device", "cuda")
                                                  for c in CASES.values()], shrink_budget=0)
        assert gpu.exit_code == cpu.exit_code and gpu.diagnosis_label == cpu.diagnosis_label


@pytest.mark.slow
@pytest.mark.moved
def test_the_device_flag_reaches_the_command_line() -> None:
    """``--device cuda`` from the command line: the kernel's verdict on a GPU, and without one
    an adapter error saying so (exit 2), never a silent run on the CPU."""
    out = subprocess.run([sys.executable, "-m", "tyingspec", "check", "ce-torch-scale-dropped",
                          "--kind", "linear-ce", "--device", "cuda", "--case",
                          "ce-logit-scale"], capture_output=True, text=True, check=False,
                         timeout=600)
    text = " ".join((out.stdout + out.stderr).split())
    if _cuda():
        assert out.returncode == 1 and "logit_scale_dropped" in text, text[-3000:]
    else:
        assert out.returncode == 2, text[-3000:]
        assert "--device cuda: torch sees no CUDA device here" in text
        assert "torch.cuda.is_available()" in text
