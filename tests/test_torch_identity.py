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
