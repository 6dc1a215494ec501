"""The linear-ce kind and the ecosystem's conventions: real kernels' forms pass as they are.

Small faithful re-implementations of real CPU cross-entropy code (transformers'
``ForCausalLMLoss``, torchtune's ``CEWithChunkedOutputLoss``, litgpt's ``chunked_cross_entropy``)
as Liger-style classes: few constructor parameters, no bias, no ``grad_output``, only
``reduction="mean"``, PyTorch's NaN for a mean over nothing.  Each must pass every case it can
run, the cases it cannot run being left out and said to be.  Then each convention on its own
(NaN loss with every target ignored; NaN or inf gradients named for what they are; grad_output
only for ``reduction="none"``; a partial ``reduction``; no bias; a drawn ignore_index), and the
two kinds of kernel right only on the default batch (right up to one block; right in float32
but not in bfloat16).

The kernels run in this process through the engine (``Target`` built here): the signature
check ``engine.observe.load`` makes today takes a class with fewer than four constructor
parameters for a torch-kind adapter, a change outside the linear-ce files (see
``kinds.linear_ce.adapter.signature_problem``, pinned below).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tyingspec import build  # noqa: E402
from tyingspec._src.engine.observe import Target, shaped  # noqa: E402
from tyingspec._src.front.check import (  # noqa: E402
    CaseResult,
    CheckReport,
    check_target,
    run_case,
)
from tyingspec._src.front.report import render_case  # noqa: E402
from tyingspec._src.kinds.linear_ce.adapter import is_torch_form, signature_problem, supported  # noqa: E402
from tyingspec._src.kinds.linear_ce.kind import (  # noqa: E402
    LONG_N,
    drawn_ignore_index,
    restricted,
    standard_ce_cases,
)
from tyingspec._src.kinds.linear_ce.zoo import ce_numpy  # noqa: E402
from tyingspec._src.kinds.table import KINDS  # noqa: E402

CASES = standard_ce_cases(0)
pytestmark = pytest.mark.usefixtures("torch_one_thread")


# --- real-style kernels ----------------------------------------------------------------------

class HFCausalLMLoss(nn.Module):
    """transformers' ``ForCausalLMLoss`` on an lm_head without bias (labels already shifted):
    logits upcast to float32, ``F.cross_entropy`` with mean (NaN when every label is -100)."""

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, weight: Tensor, input: Tensor, target: Tensor) -> Tensor:
        logits = (input @ weight.T).float()  # "Upcast to float if we need to compute the loss"
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index,
                               reduction="mean")


class TorchtuneChunkedCE(nn.Module):
    """torchtune's ``CEWithChunkedOutputLoss``: the output projection in ``num_output_chunks``
    chunks (as its decoder makes them), a float32 sum per chunk, divided by the count of
    labels that are not ignore_index (0/0 = NaN when there is none)."""

    def __init__(self, num_output_chunks: int = 8, ignore_index: int = -100) -> None:
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def forward(self, weight: Tensor, input: Tensor, target: Tensor) -> Tensor:
        logits = [chunk @ weight.T for chunk in input.chunk(self.num_output_chunks)]
        labels = target.chunk(self.num_output_chunks)
        total_elements = (target != self.ignore_index).sum()
        total_loss: Tensor | float = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels, strict=True):
            total_loss = total_loss + F.cross_entropy(
                logits_chunk.float(), labels_chunk, ignore_index=self.ignore_index,
                reduction="sum")
        assert isinstance(total_loss, Tensor)
        return total_loss / total_elements


def chunked_cross_entropy(logits: Tensor, targets: Tensor, chunk_size: int = 128,
                          ignore_index: int = -100) -> Tensor:
    """litgpt's ``chunked_cross_entropy`` (unchunked lm_head): per-token losses in chunks,
    summed and divided by max(count, 1) (0 when every target is ignored)."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    if chunk_size == 0:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    logit_chunks = logits.split(chunk_size)  # type: ignore[no-untyped-call]
    target_chunks = targets.split(chunk_size)  # type: ignore[no-untyped-call]
    loss_chunks = [F.cross_entropy(lc, tc, ignore_index=ignore_index, reduction="none")
                   for lc, tc in zip(logit_chunks, target_chunks, strict=True)]
    non_masked_elems = (targets != ignore_index).sum()
    total: Tensor = torch.cat(loss_chunks).sum()
    return total / non_masked_elems.maximum(torch.ones_like(non_masked_elems))


class LitGPTHead(nn.Module):
    """litgpt's lm_head (no bias) followed by its ``chunked_cross_entropy``."""

    def __init__(self, chunk_size: int = 128, ignore_index: int = -100) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index

    def forward(self, weight: Tensor, input: Tensor, target: Tensor) -> Tensor:
        return chunked_cross_entropy(input @ weight.T, target, self.chunk_size,
                                     self.ignore_index)


def in_process(spec: str, fn: Callable[..., Any], cases: list[Any] | None = None,
               ) -> tuple[list[CaseResult], list[str]]:
    """``tyingspec check`` on ``fn`` through the engine in this process, without shrinking."""
    target = Target(f"test_linear_ce_conventions:{spec}", KINDS["linear-ce"], fn)
    kept, notes = shaped(target, CASES if cases is None else cases)
    return [run_case(target, c, 0, do_shrink=False) for c in kept], notes


def statuses(results: list[CaseResult]) -> dict[str, str]:
    return {r.case.name: r.status for r in results}


def headline(r: CaseResult) -> str:
    assert r.diagnosis is not None, r.error
    return r.diagnosis.headline()


@pytest.mark.parametrize("cls", [HFCausalLMLoss, TorchtuneChunkedCE, LitGPTHead])
def test_real_style_kernels_pass_every_case_they_can_run(cls: type[nn.Module]) -> None:
    results, notes = in_process(cls.__name__, cls)
    got = statuses(results)
    # every target ignored: NaN (transformers, torchtune) or 0 (litgpt), both the convention
    assert got.pop("ce-all-ignored") == "no_power"
    # a low-precision case may be blind to a known bug (its error inside the bound): it says
    # so (no_power, naming the bug), and the same option's float64 case has the power
    low = {r.case.name for r in results if r.case.dtype in ("bfloat16", "float16")}
    assert {s for n, s in got.items() if n not in low} == {"correct"}, [
        (r.case.name, r.error or headline(r)) for r in results if r.status != "correct"]
    assert {got[n] for n in low} <= {"correct", "no_power"}
    assert all("cannot tell them from a correct kernel" in headline(r) for r in results
               if r.case.name in low and r.status == "no_power")
    # the long batch, the bfloat16 one and a drawn ignore_index ran; what needs an option
    # the class does not declare (a bias, a logit scale, a sum) was left out and said to be
    assert {"ce-long", "ce-bfloat16", "ce-ignore-index", "ce-plain"} <= set(got)
    assert "left out ce-bias: needs option(s) bias, which the kernel does not declare" in notes
    assert any(n.startswith("left out ce-sum: needs option(s) reduction=sum") for n in notes)


def test_the_hf_re_implementation_is_transformers_own_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    rng = np.random.default_rng(3)
    h = torch.tensor(rng.normal(size=(9, 4)))
    W = torch.tensor(rng.normal(size=(6, 4)))
    y = torch.tensor([1, -100, 5, 0, 0, -100, 2, 3, 4])
    for labels in (y, torch.full_like(y, -100)):
        ours_h, theirs_h = h.clone().requires_grad_(), h.clone().requires_grad_()
        ours = HFCausalLMLoss()(W, ours_h, labels)
        theirs = ForCausalLMLoss((theirs_h @ W.T), None, vocab_size=6, shift_labels=labels)
        np.testing.assert_allclose(ours.item(), theirs.item(), rtol=1e-6, atol=1e-7,
                                   equal_nan=True)
        ours.backward()
        theirs.backward()  # type: ignore[no-untyped-call]
        assert ours_h.grad is not None and theirs_h.grad is not None
        np.testing.assert_allclose(ours_h.grad.numpy(), theirs_h.grad.numpy(), rtol=1e-6,
                                   atol=1e-7)
    assert np.isnan(ours.item())  # every label ignored: PyTorch's 0/0, zero gradients
    assert not ours_h.grad.any()


# --- each convention -------------------------------------------------------------------------

class PlainCE(nn.Module):
    """F.cross_entropy with a bias and two options: NaN for a mean over nothing."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, weight: Tensor, input: Tensor, target: Tensor,
                bias: Tensor | None = None) -> Tensor:
        logits = input @ weight.T + (0 if bias is None else bias)
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index,
                               reduction=self.reduction)


def test_every_target_ignored_with_mean_may_return_nan_or_zero() -> None:
    only = [c for c in CASES if c.name == "ce-all-ignored"]
    for spec, fn in (("plain", PlainCE), ("numpy", ce_numpy)):
        (r,), _ = in_process(spec, fn, only)
        assert r.status == "no_power", headline(r)
        assert r.diagnosis is not None and all(not f.failed for f in r.diagnosis.findings)



def smoothing_ignored_raising(h: Any, E: Any, targets: Any, b: Any = None, *,
                              label_smoothing: float = 0.0, ignore_index: int = -100,
                              ) -> dict[str, Any]:
    """Liger 0.2.0's two defects in numpy: ``label_smoothing`` taken and ignored, and a mean
    that divides by the count of live tokens, raising when there is none."""
    live = int(np.sum(np.asarray(targets) != ignore_index))
    1 / live  # noqa: B018  (ZeroDivisionError on a batch of ignored tokens only)
    return dict(ce_numpy(h, E, targets, b, ignore_index=ignore_index))


def test_a_wrong_case_exits_1_beside_a_case_where_the_kernel_raised() -> None:
    # exit 1 means a wrong gradient and nothing else: a case proving one outranks a case that
    # raised (exit 2 alone), and that case is still reported, as the kernel's own exception
    names = ("ce-label-smoothing", "ce-all-ignored")
    results, _ = in_process("smoothing-ignored-raising", smoothing_ignored_raising,
                            [c for c in CASES if c.name in names])
    report = CheckReport("test_linear_ce_conventions:smoothing-ignored-raising", "linear-ce",
                         0, results)
    got = {r.case.name: r for r in results}
    assert got["ce-label-smoothing"].status == "wrong"
    assert report.verdict == "wrong" and report.exit_code == 1
    assert report.diagnosis_label == "option_ignored"
    raised = got["ce-all-ignored"]
    assert raised.status == "adapter_error" and raised.error is not None
    assert "raised on a batch whose every target is ignored" in raised.error
    assert "ZeroDivisionError: division by zero at " in raised.error
    assert f"error: {raised.error}" in report.diagnosis
    assert "1 wrong" in report.diagnosis and "1 adapter error" in report.diagnosis
    # without a wrong case the same error is exit 2, as before
    assert CheckReport(report.target, "linear-ce", 0, [raised]).exit_code == 2


def nan_everywhere(h: Any, E: Any, targets: Any, b: Any = None, *, ignore_index: int = -100,
                   ) -> dict[str, Any]:
    """A mean over nothing whose 0/0 reached the gradients too."""
    out: dict[str, Any] = dict(ce_numpy(h, E, targets, b, ignore_index=ignore_index))
    if np.all(np.asarray(targets) == ignore_index):
        out["loss"] = float("nan")
        out["dh"] = np.full_like(out["dh"], np.nan)
    return out


def nan_dh(h: Any, E: Any, targets: Any, b: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = dict(ce_numpy(h, E, targets, b))
    out["dh"] = out["dh"].copy()
    out["dh"][3, 1] = np.nan
    return out


def inf_dE_db(h: Any, E: Any, targets: Any, b: Any = None, *, ignore_index: int = -100,
              ) -> dict[str, Any]:
    out: dict[str, Any] = dict(ce_numpy(h, E, targets, b, ignore_index=ignore_index))
    out["dE"] = out["dE"].copy()
    out["dE"][2] = np.inf
    if out["db"] is not None:
        out["db"] = out["db"].copy()
        out["db"][1] = -np.inf
    return out


def test_nan_or_inf_gradients_are_named_for_what_they_are() -> None:
    (r,), _ = in_process("nan-everywhere", nan_everywhere,
                         [c for c in CASES if c.name == "ce-all-ignored"])
    assert r.status == "wrong" and r.diagnosis is not None
    assert r.diagnosis.label == "not_finite"
    detail = r.diagnosis.detail
    assert "loss holds NaN in 1 of 1 entry; dh holds NaN in 138 of 138 entries" in detail
    assert "Every token is ignored" in detail and "logsumexp" not in detail
    plain = [c for c in CASES if c.name == "ce-plain"]
    (r,), _ = in_process("nan-dh", nan_dh, plain)
    assert r.diagnosis is not None and r.diagnosis.label == "not_finite"
    assert "dh holds NaN in 1 of 138 entries (tokens [3])" in r.diagnosis.detail
    assert "the backward made the non-finite dh" in r.diagnosis.detail
    assert "logsumexp" not in r.diagnosis.detail and "max shift" not in r.diagnosis.detail
    (r,), _ = in_process("inf", inf_dE_db, [c for c in CASES if c.name == "ce-bias"])
    assert r.diagnosis is not None
    assert "dE holds inf in 6 of 222 entries (rows [2])" in r.diagnosis.detail
    assert "db holds inf in 1 of 37 entries (entries [1])" in r.diagnosis.detail
    # where the logits do overflow a naive exp, that is said
    large = [c for c in CASES if c.name == "ce-large-logits"]
    report = check_target("ce-overflow", "linear-ce", 0, large)
    assert "without the max shift overflows" in report.results[0].diagnosis.detail  # type: ignore[union-attr]


def no_grad_output(h: Any, E: Any, targets: Any, b: Any = None, *, ignore_index: int = -100,
                   reduction: str = "mean") -> dict[str, Any]:
    assert reduction != "none", "never run on reduction none"
    return dict(ce_numpy(h, E, targets, b, ignore_index=ignore_index,
                         reduction=reduction))  # type: ignore[arg-type]


def test_grad_output_is_needed_only_by_reduction_none() -> None:
    assert "grad_output" not in supported(no_grad_output)
    results, notes = in_process("no-grad-output", no_grad_output)
    got = statuses(results)
    assert "adapter_error" not in got.values(), [r.error for r in results]
    assert got["ce-sum"] == "correct" and got["ce-plain"] == "correct"
    assert "left out ce-none: needs option(s) grad_output, which the kernel does not declare" \
        in notes


def test_a_class_with_few_constructor_parameters_is_a_linear_ce_class() -> None:
    for cls in (HFCausalLMLoss, TorchtuneChunkedCE, LitGPTHead, PlainCE):
        assert is_torch_form(cls) and signature_problem(cls) is None, cls
    assert signature_problem(ce_numpy) is None

    class NeedsVocab(nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()

    class TwoArguments(nn.Module):
        def forward(self, logits: Tensor, target: Tensor) -> Tensor:
            return logits

    assert "requires vocab" in str(signature_problem(NeedsVocab))
    assert "(weight, input, target[, bias])" in str(signature_problem(TwoArguments))

    def two(h: Any, E: Any) -> None: ...

    assert "f(h, E, targets[, b]" in str(signature_problem(two))


def no_bias(h: Any, E: Any, targets: Any, *, grad_output: Any = None, ignore_index: int = -100,
            ) -> dict[str, Any]:
    return dict(ce_numpy(h, E, targets, None, grad_output=grad_output,
                         ignore_index=ignore_index))


def test_kernels_without_a_bias_run_without_one() -> None:
    assert "bias" not in supported(no_bias) and "bias" not in supported(HFCausalLMLoss)
    assert "bias" in supported(PlainCE) and "bias" in supported(ce_numpy)
    for spec, fn in (("no-bias", no_bias), ("hf", HFCausalLMLoss)):
        results, notes = in_process(f"bias-{spec}", fn)
        got = statuses(results)
        assert got["ce-plain"] == got["ce-ignored"] == got["ce-long"] == "correct", spec
        assert "ce-bias" not in got
        assert any(n.startswith("left out ce-bias: needs option(s) bias") for n in notes)
    # what a property draws for such a kernel: the bias taken out, not run as absent
    bias_case = next(c for c in CASES if c.name == "ce-bias")
    assert bias_case.bias and not restricted(bias_case, supported(no_bias)).bias


def mean_or_sum(h: Any, E: Any, targets: Any, b: Any = None, *,
                reduction: Literal["mean", "sum"] = "mean") -> dict[str, Any]:
    if reduction not in ("mean", "sum"):
        raise ValueError("mean or sum only")
    return dict(ce_numpy(h, E, targets, b, reduction=reduction))


def test_a_kernel_may_declare_part_of_an_option() -> None:
    assert "reduction=none" not in supported(mean_or_sum)
    assert {"reduction=mean", "reduction=sum"} <= set(supported(mean_or_sum))
    results, notes = in_process("mean-or-sum", mean_or_sum)
    got = statuses(results)
    assert got["ce-sum"] == got["ce-plain"] == "correct"
    assert "ce-none" not in got and "adapter_error" not in got.values()
    assert any(n.startswith("left out ce-none: needs option(s) grad_output, reduction=none")
               for n in notes)

    def evaluated(h: Any, E: Any, targets: Any, b: Any = None, *, grad_output: Any = None,
                  reduction: str = "mean") -> dict[str, Any]:
        return mean_or_sum(h, E, targets, b, reduction=reduction)  # type: ignore[arg-type]

    # an annotation that is a typing object, not a string, reads the same
    evaluated.__annotations__["reduction"] = Literal["mean", "sum"]
    assert "reduction=none" not in supported(evaluated)
    assert "reduction=sum" in supported(evaluated)


def test_ignore_index_is_drawn_and_a_hard_coded_one_is_caught() -> None:
    ignored = next(c for c in CASES if c.name == "ce-ignored")
    unset = [drawn_ignore_index(ignored.__class__(**{**ignored.__dict__, "seed": s,
                                                      "ce": "ignored=0.3"})) for s in range(40)]
    assert -100 in unset and any(0 <= v < ignored.V for v in unset)
    case = next(c for c in CASES if c.name == "ce-ignore-index")
    ii = drawn_ignore_index(case)
    assert 0 <= ii < case.V
    batch = build(case)
    assert np.sum(batch.targets == ii) >= 7 and f"ignore_index={ii}" in batch.ce
    report = check_target("ce-ignore-index-hard-coded", "linear-ce", 0, CASES)
    assert report.diagnosis_label == "ignored_not_zeroed"
    wrong = [r for r in report.results if r.status == "wrong"]
    assert [r.case.name for r in wrong] == ["ce-ignore-index"]
    assert "hard-coded" in headline(wrong[0])
    assert check_target("ce-numpy", "linear-ce", 0, [case]).exit_code == 0


def test_reports_name_db_entries_and_never_a_zero_or_infinite_bound() -> None:
    report = check_target("ce-bias-grad-wrong", "linear-ce", 0,
                          [c for c in CASES if c.name == "ce-bias"], shrink_budget=0)
    (r,) = report.results
    text = "\n".join(render_case(r))
    assert "entries of db wrong: [0, 1, 2" in text and "the reference" in text
    cases = [c for c in CASES if c.name in ("ce-all-ignored", "ce-bias")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarnings stay inside the check
        for spec, fn in (("r-nan", nan_everywhere), ("r-inf", inf_dE_db), ("r-plain", PlainCE),
                         ("r-numpy", ce_numpy)):
            results, _ = in_process(spec, fn, cases)
            for r in results:
                text = "\n".join(render_case(r))
                assert "infx" not in text and "atol 0..0" not in text, text


# --- kernels right only on the default batch (issue 18) --------------------------------------

def test_the_standard_cases_reach_past_two_blocks_and_a_low_precision() -> None:
    long = next(c for c in CASES if c.name == "ce-long")
    assert long.N == LONG_N > 2 * 4096 // 2 and all(LONG_N % B for B in (7, 256, 512, 1024,
                                                                          2048, 4096))
    assert long.V * long.d <= 64  # cheap: the length is the point, not the width
    assert any(c.dtype == "bfloat16" for c in CASES)


def test_a_kernel_right_up_to_one_block_is_caught_and_named() -> None:
    cases = [c for c in CASES if c.name in ("ce-plain", "ce-long")]
    report = check_target("ce-block-overwritten", "linear-ce", 0, cases, shrink_budget=0)
    got = {r.case.name: r for r in report.results}
    assert got["ce-plain"].status == "correct"
    assert got["ce-long"].status == "wrong"
    assert got["ce-long"].diagnosis is not None
    assert got["ce-long"].diagnosis.label == "dE_wrong_dh_right"
    assert "the last block of 1024" in got["ce-long"].diagnosis.detail
    assert f"tokens [7168, {LONG_N})" in got["ce-long"].diagnosis.detail


def test_a_kernel_wrong_only_in_bfloat16_is_caught_and_named() -> None:
    cases = [c for c in CASES if c.name in ("ce-ignored", "ce-bfloat16", "ce-large-logits")]
    report = check_target("ce-torch-half-unmasked", "linear-ce", 0, cases, shrink_budget=0)
    got = {r.case.name: r for r in report.results}
    assert got["ce-ignored"].status == got["ce-large-logits"].status == "correct"
    assert got["ce-bfloat16"].status == "wrong" and got["ce-bfloat16"].precision == "bfloat16"
    assert got["ce-bfloat16"].diagnosis is not None
    assert got["ce-bfloat16"].diagnosis.label == "ignored_not_zeroed"
    assert check_target("ce-torch", "linear-ce", 0, cases).exit_code == 0
