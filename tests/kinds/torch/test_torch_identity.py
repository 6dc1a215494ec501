"""The tie identity and optimizer checks of the torch kind, on small models built here."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tyingspec._src.core.findings import Finding
from tyingspec._src.kinds.torch.identity import identity_findings, optimizer_findings

EMB, HEAD = "transformer.wte.weight", "lm_head.weight"
VOCAB, WIDTH = 13, 8
IDENTITY = ["identity after deepcopy", "identity after .to(torch.float64)",
            "identity after load_state_dict",
            "identity after load_state_dict(assign=True) + re-tie",
            "identity after a safetensors round trip",
            "identity after meta-device init + to_empty() + re-tie",
            "identity after resize_token_embeddings", "identity after one optimizer step"]


class Tiny(nn.Module):
    """nanoGPT's tie: the head's weight is the embedding's Parameter, by assignment."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, WIDTH)})
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(torch.tanh(self.transformer.wte(idx)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Retied(Tiny):
    def tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight


class CloningRetie(Tiny):
    # The bug: a "re-tie" that gives the head its own copy.
    def tie_weights(self) -> None:
        self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach().clone())


class Resizable(Retied):
    def resize_token_embeddings(self, rows: int) -> None:
        old = self.transformer.wte.weight
        self.transformer.wte = nn.Embedding(rows, WIDTH)
        with torch.no_grad():
            self.transformer.wte.weight[: old.shape[0]] = old
        self.lm_head = nn.Linear(WIDTH, rows, bias=False)
        if self.ties_on_resize:
            self.tie_weights()

    ties_on_resize = True


class ResizeForgetsTie(Resizable):
    ties_on_resize = False


def tiny_loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.arange(12).reshape(2, 6) % VOCAB
    out: torch.Tensor = model(tokens, (tokens * 5 + 1) % VOCAB)
    return out


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=8, n_embd=16, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def gpt2_loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.arange(12).reshape(2, 6) * 7 % 61
    out: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return out


def identity(factory: Callable[[], nn.Module], loss_of: Callable[[nn.Module], torch.Tensor]
             = tiny_loss, **kw: object) -> dict[str, Finding]:
    found = identity_findings(factory, EMB, HEAD, retie=kw.get("retie"),  # type: ignore[arg-type]
                              loss_of=loss_of)
    assert [f.check for f in found] == IDENTITY
    return {f.check.removeprefix("identity after "): f for f in found}


def outcomes(found: dict[str, Finding]) -> dict[str, str]:
    return {name: f.outcome for name, f in found.items()}


def test_plain_tied_module_passes_what_needs_no_retie() -> None:
    found = identity(Tiny)
    assert outcomes(found) == {
        "deepcopy": "passed", ".to(torch.float64)": "passed", "load_state_dict": "passed",
        "load_state_dict(assign=True) + re-tie": "not_applicable",
        "a safetensors round trip": "passed",
        "meta-device init + to_empty() + re-tie": "not_applicable",
        "resize_token_embeddings": "not_applicable", "one optimizer step": "passed"}
    assert "re-tie by hand" in found["load_state_dict(assign=True) + re-tie"].detail
    assert "to_empty()" in found["meta-device init + to_empty() + re-tie"].detail


def test_tie_weights_method_or_target_retie_restores_the_tie() -> None:
    for found in (identity(Retied),
                  identity(Tiny, retie=lambda m: setattr(m.lm_head, "weight",
                                                         m.transformer.wte.weight))):
        assert found["load_state_dict(assign=True) + re-tie"].outcome == "passed"
        assert found["meta-device init + to_empty() + re-tie"].outcome == "passed"


def test_cloning_tie_weights_loses_the_tie() -> None:
    found = identity(CloningRetie)
    for name in ("load_state_dict(assign=True) + re-tie",
                 "meta-device init + to_empty() + re-tie"):
        f = found[name]
        assert (f.outcome, f.label) == ("failed", "tie_lost"), f
        assert "two Parameters" in f.detail and EMB in f.detail and HEAD in f.detail
    assert "tie_weights()" in found["load_state_dict(assign=True) + re-tie"].detail


def test_resize_must_keep_the_tie() -> None:
    assert identity(Resizable)["resize_token_embeddings"].outcome == "passed"
    f = identity(ResizeForgetsTie)["resize_token_embeddings"]
    assert (f.outcome, f.label) == ("failed", "tie_lost")
    assert "resize_token_embeddings(21)" in f.detail


def test_a_load_that_keeps_the_fresh_values_is_caught() -> None:
    class Ignores(Tiny):
        def load_state_dict(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            pass  # loads nothing: the fresh model keeps its initial values

    f = identity(Ignores)["load_state_dict"]
    assert (f.outcome, f.label) == ("failed", "tie_lost")
    assert "saved values" in f.detail


def test_meta_failure_is_not_applicable() -> None:
    class DataDependent(Retied):
        def __init__(self) -> None:
            super().__init__()
            # .item() needs real data: no meta tensor has it.
            self.scale = float(self.transformer.wte.weight.abs().max().item())

    f = identity(DataDependent)["meta-device init + to_empty() + re-tie"]
    assert f.outcome == "not_applicable" and "meta" in f.detail


def test_gpt2_passes_all_eight() -> None:
    found = identity(gpt2, gpt2_loss)
    assert all(f.outcome == "passed" for f in found.values()), found


def test_default_optimizers_pass_on_a_correct_model() -> None:
    found = optimizer_findings(Tiny, EMB, HEAD, optimizer=None, loss_of=tiny_loss)
    assert [f.check for f in found] == ["optimizer SGD", "optimizer AdamW"]
    assert all(f.outcome == "passed" for f in found), found
    assert all("exactly one update" in f.detail for f in found)


@pytest.mark.parametrize("build", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                              weight_decay=0.1),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.05, maximize=True),
    lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1),
    lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True),
], ids=["sgd-nesterov-wd", "sgd-maximize", "adam-l2", "adamw-amsgrad"])
def test_target_optimizers_in_closed_form_pass(build: Callable[[nn.Module], object]) -> None:
    f = optimizer_findings(Tiny, EMB, HEAD, optimizer=build,  # type: ignore[arg-type]
                           loss_of=tiny_loss)[-1]
    assert (f.check, f.outcome) == ("optimizer from the target", "passed"), f
    assert "exactly one update" in f.detail


def test_unknown_optimizer_is_counted_not_sized() -> None:
    f = optimizer_findings(Tiny, EMB, HEAD, loss_of=tiny_loss,
                           optimizer=lambda m: torch.optim.RMSprop(m.parameters()))[-1]
    assert f.outcome == "passed" and "update size not checked" in f.detail


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_optimizer_given_both_names_sees_the_tie_twice(kind: type) -> None:
    def both(m: nn.Module) -> torch.optim.Optimizer:
        opt: torch.optim.Optimizer = kind(
            [p for _, p in m.named_parameters(remove_duplicate=False)], lr=0.01)
        return opt

    f = optimizer_findings(Tiny, EMB, HEAD, optimizer=both, loss_of=tiny_loss)[-1]
    assert (f.outcome, f.label) == ("failed", "optimizer_sees_tie_twice"), f
    assert "listed 2 times" in f.detail and "duplicate parameters" in f.detail
    assert "moved by 2.00 updates" in f.detail


def test_same_parameter_in_two_groups_fails() -> None:
    def two_groups(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [m.get_parameter(EMB)]},
                                  {"params": [m.get_parameter(HEAD)], "weight_decay": 0.0}])

    f = optimizer_findings(Tiny, EMB, HEAD, optimizer=two_groups, loss_of=tiny_loss)[-1]
    assert (f.outcome, f.label) == ("failed", "optimizer_sees_tie_twice"), f
    assert "more than one parameter group" in f.detail


def test_gpt2_default_optimizers_pass() -> None:
    found = optimizer_findings(gpt2, EMB, HEAD, optimizer=None, loss_of=gpt2_loss)
    assert all(f.outcome == "passed" for f in found), found


def test_without_a_real_retie_torch_unties_on_assign_and_to_empty() -> None:
    # What torch itself does: assign=True leaves two Parameters over the state dict's one
    # storage, to_empty() two Parameters with two storages.
    found = identity(Tiny, retie=lambda m: None)
    assign = found["load_state_dict(assign=True) + re-tie"]
    assert (assign.outcome, assign.label) == ("failed", "tie_lost")
    assert "two Parameters over one storage" in assign.detail
    meta = found["meta-device init + to_empty() + re-tie"]
    assert (meta.outcome, meta.label) == ("failed", "tie_lost")
    assert "storages 0x" in meta.detail and "the target's retie" in meta.detail


# --- at the run's precision (issue 49 §3) -------------------------------------------------------

def led() -> nn.Module:
    """transformers' LEDModelTester configuration (tests/models/led/test_modeling_led.py)."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    return LEDForConditionalGeneration(LEDConfig(
        vocab_size=99, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4,
        decoder_ffn_dim=4, max_position_embeddings=32, eos_token_id=2, pad_token_id=1,
        bos_token_id=0, attention_window=4))


def led_loss(model: nn.Module) -> torch.Tensor:
    # 13 positions: LED pads them to 16 (a multiple of 2 x attention_window), and its float64
    # backward through that padding is NaN in some entries (its float32 one is finite)
    tokens = (torch.arange(26).reshape(2, 13) * 7 + 3) % 99
    out: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return out


LED_EMB, LED_HEAD = "led.shared.weight", "lm_head.weight"


def test_the_optimizer_check_runs_in_the_models_own_dtype() -> None:
    # the model trains in float32; a float64 build of it gives a NaN gradient that was read as
    # "moved although the closed-form update is zero" (unknown, exit 1)
    found = optimizer_findings(led, LED_EMB, LED_HEAD, optimizer=None, loss_of=led_loss)
    assert [(f.outcome, f.detail) for f in found] == [("passed", "moved by exactly one update")] * 2


def test_a_nan_the_models_backward_produces_is_named_not_called_a_tie_bug() -> None:
    torch.manual_seed(0)
    assert not torch.isfinite(_grad_of(led().double(), led_loss, LED_EMB)).all()  # the premise
    found = optimizer_findings(led, LED_EMB, LED_HEAD, optimizer=None, loss_of=led_loss,
                               dtype=torch.float64)
    for f in found:
        assert f.outcome == "passed" and f.label is None, f
        assert "not finite at float64" in f.detail and "NaN" in f.detail, f
        assert "no tie bug" in f.detail and "moved by exactly one update" in f.detail


def _grad_of(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor],
             name: str) -> torch.Tensor:
    loss_of(model).backward()  # type: ignore[no-untyped-call]
    grad = model.get_parameter(name).grad
    assert grad is not None
    return grad


class NaNLoss(Tiny):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, targets) * torch.tensor(float("nan"))


def test_a_gradient_with_no_finite_entry_leaves_the_update_unjudged() -> None:
    for f in optimizer_findings(NaNLoss, EMB, HEAD, optimizer=None, loss_of=tiny_loss):
        assert f.outcome == "not_applicable", f
        assert f"{VOCAB * WIDTH} of {VOCAB * WIDTH} entries ({VOCAB * WIDTH} NaN)" in f.detail


def test_a_twice_listed_tie_is_still_caught_beside_a_nan_gradient() -> None:
    def both(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for _, p in m.named_parameters(remove_duplicate=False)],
                               lr=0.01)

    f = optimizer_findings(NaNLoss, EMB, HEAD, optimizer=both, loss_of=tiny_loss)[-1]
    assert (f.outcome, f.label) == ("failed", "optimizer_sees_tie_twice"), f
    assert "listed 2 times" in f.detail and "NaN" in f.detail


class MaxNorm(Tiny):
    """nn.Embedding(max_norm=...): the forward rescales the rows it reads in place."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.wte = nn.Embedding(VOCAB, WIDTH, max_norm=1.0)
        self.lm_head.weight = self.transformer.wte.weight


def test_the_update_is_measured_from_where_the_forward_left_the_table() -> None:
    # the step starts from the renormalised rows: measured from the values before the
    # forward, the one correct update read as 1.16 (SGD) or 1.92 (AdamW) updates
    found = optimizer_findings(MaxNorm, EMB, HEAD, optimizer=None, loss_of=tiny_loss)
    assert all(f.outcome == "passed" for f in found), found


def test_at_bfloat16_a_second_update_still_shows() -> None:
    def bf16() -> nn.Module:
        return Tiny().to(torch.bfloat16)

    def loss(m: nn.Module) -> torch.Tensor:
        return tiny_loss(m).float()

    once = optimizer_findings(bf16, EMB, HEAD, loss_of=loss,
                              optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    assert once[-1].outcome == "passed" and "exactly one update" in once[-1].detail, once

    def twice(m: nn.Module) -> torch.optim.Optimizer:
        # the update applied twice, with the tie held once: only the update can show it
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        once = opt.step

        def step(closure: object = None) -> None:
            once()
            opt.state.clear()
            once()
        opt.step = step  # type: ignore[method-assign]
        return opt

    f = optimizer_findings(bf16, EMB, HEAD, loss_of=loss, optimizer=twice)[-1]
    assert (f.outcome, f.label) == ("failed", "optimizer_sees_tie_twice"), f
    moved = float(f.detail.split("moved by ")[1].split()[0])
    assert 1.8 < moved < 2.2, f


def test_an_update_below_the_dtypes_rounding_is_not_claimed_as_seen() -> None:
    def bf16() -> nn.Module:
        return Tiny().to(torch.bfloat16)

    f = optimizer_findings(bf16, EMB, HEAD, loss_of=lambda m: tiny_loss(m).float(),
                           optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-6))[-1]
    assert f.outcome == "not_applicable", f
    assert "within bfloat16's rounding" in f.detail


def test_identity_checks_build_at_the_precision_asked() -> None:
    seen: list[torch.dtype] = []

    def loss(m: nn.Module) -> torch.Tensor:
        seen.append(m.get_parameter(EMB).dtype)
        return tiny_loss(m)

    found = identity_findings(Retied, EMB, HEAD, retie=None, loss_of=loss, dtype=torch.float64)
    assert seen == [torch.float64]  # the one optimizer step
    assert outcomes({f.check: f for f in found}) == outcomes(
        {f.check: f for f in identity_findings(Retied, EMB, HEAD, retie=None,
                                               loss_of=tiny_loss)})
    optimizer_findings(Retied, EMB, HEAD, optimizer=None, loss_of=loss, dtype=torch.float64)
    assert seen == [torch.float64] * 3


class WeightNormed(nn.Module):
    """A functional head on a weight-normed lookup: the tied table is W = g * v / |v|, and
    the optimizer holds g and v (the parametrization's originals)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        torch.nn.utils.parametrizations.weight_norm(self.wte)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.wte(idx))
        return F.cross_entropy(F.linear(x, self.wte.weight).flatten(0, 1), targets.flatten())


V_NAME = "wte.parametrizations.weight.original1"  # weight norm's v, [V, d]: the tie's name


def test_a_parametrized_tables_parameters_are_each_checked_once() -> None:
    found = optimizer_findings(WeightNormed, V_NAME, V_NAME, optimizer=None, loss_of=tiny_loss)
    for f in found:
        assert f.outcome == "passed", f
        assert f"{V_NAME}: moved by exactly one update" in f.detail
        assert "wte.parametrizations.weight.original0: moved by exactly one update" in f.detail

    def v_twice(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([*m.parameters(), m.get_parameter(V_NAME)], lr=0.01)

    f = optimizer_findings(WeightNormed, V_NAME, V_NAME, optimizer=v_twice,
                           loss_of=tiny_loss)[-1]
    assert (f.outcome, f.label) == ("failed", "optimizer_sees_tie_twice"), f
    assert f"{V_NAME}: the tied Parameter is listed 2 times" in f.detail
