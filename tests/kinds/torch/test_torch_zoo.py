"""The built-in torch targets, checked with plain torch (not with tyingspec's checker).

Each correct built-in must have one Parameter under both names, a gradient equal to the sum of
its untied paths, micro-batches that add up and a backward that agrees with its forward; each
broken one must show its own bug, measured directly.  Gradients are compared in float64.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402
from torch.func import functional_call  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tyingspec._src.core.diagnosis import LABELS  # noqa: E402
from tyingspec._src.kinds.torch.target import TorchTarget  # noqa: E402
from tyingspec._src.kinds.torch.zoo import TORCH_BUILTINS, builtin_target  # noqa: E402

EMB, HEAD = "transformer.wte.weight", "lm_head.weight"
# 3 four times, 5 three times, 0 and 2 twice: repeats on both sequences, and the padding row
TOKENS = torch.tensor([[3, 5, 3, 0, 7, 3, 5, 9], [1, 3, 2, 2, 8, 0, 4, 5]])
TARGETS = torch.tensor([[5, 3, 0, 7, 3, 5, 9, 1], [3, 2, 2, 8, 0, 4, 5, 6]])
OTHER_TOKENS = torch.tensor([[11, 12, 11, 40, 0, 60, 12, 11], [7, 7, 7, 30, 31, 32, 2, 1]])
OTHER_TARGETS = torch.tensor([[12, 11, 40, 0, 60, 12, 11, 7], [7, 7, 30, 31, 32, 2, 1, 9]])
REPEATED = [0, 2, 3, 5]
ONCE = [1, 4, 7, 8, 9]
# float64 gradients computed along different but equivalent routes (tied vs untied, one batch
# vs micro-batches) differ by a few roundings of entries of size 1e-4..1e-1
RTOL, ATOL = 1e-7, 1e-12


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def far(actual: Tensor, expected: Tensor) -> None:
    """Different by much more than rounding: at least 1e-6 somewhere, far beyond RTOL/ATOL."""
    assert float((actual - expected).abs().max()) > 1e-6


def factory(name: str) -> Callable[[], nn.Module]:
    target = builtin_target(name)
    return target.model if isinstance(target, TorchTarget) else target


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return factory(name)().double()


def is_gpt2(model: nn.Module) -> bool:
    return hasattr(model, "get_input_embeddings")


def loss_of(model: nn.Module, tokens: Tensor = TOKENS, targets: Tensor = TARGETS,
            params: dict[str, Tensor] | None = None) -> Tensor:
    def call(*args: Any, **kwargs: Any) -> Any:
        if params is None:
            return model(*args, **kwargs)
        return functional_call(model, params, args, kwargs, tie_weights=False)

    if not is_gpt2(model):
        return call(tokens, targets)[1]
    # transformers' own loss (labels=tokens, shifted inside) casts the logits to float32 even
    # in a float64 model (see the test below), too coarse for finite differences; this is that
    # loss in float64
    logits = call(input_ids=tokens).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                           tokens[:, 1:].reshape(-1))


def grad(model: nn.Module, tokens: Tensor = TOKENS, targets: Tensor = TARGETS) -> Tensor:
    model.zero_grad()
    loss_of(model, tokens, targets).backward()
    g = model.get_parameter(EMB).grad
    assert g is not None
    return g.clone()


def untied(model: nn.Module, tokens: Tensor = TOKENS,
           targets: Tensor = TARGETS) -> tuple[Tensor, Tensor]:
    """(dE_in, dE_out): autograd of the model with the two uses given separate matrices."""
    E = model.get_parameter(EMB).detach()
    E1, E2 = E.clone().requires_grad_(), E.clone().requires_grad_()
    loss = loss_of(model, tokens, targets, params={EMB: E1, HEAD: E2})
    d_in, d_out = torch.autograd.grad(loss, (E1, E2))
    return d_in, d_out


def twin(model: nn.Module, name: str = "nanogpt") -> nn.Module:
    """The correct built-in ``name`` holding the same weights as ``model``."""
    ref = build(name)
    ref.load_state_dict(model.state_dict())
    return ref


def micro_batched(model: nn.Module) -> Tensor:
    """E.grad after one micro-batch per sequence, each loss divided by their number."""
    model.zero_grad()
    k = TOKENS.size(0)
    for i in range(k):
        (loss_of(model, TOKENS[i:i + 1], TARGETS[i:i + 1]) / k).backward()
    g = model.get_parameter(EMB).grad
    assert g is not None
    return g.clone()


def directional(model: nn.Module, v: Tensor, eps: float = 1e-5) -> tuple[float, float]:
    """(central difference of the loss along v, <E.grad, v>)."""
    g = grad(model)
    E = model.get_parameter(EMB)
    with torch.no_grad():
        E += eps * v
        up = loss_of(model).item()
        E -= 2 * eps * v
        down = loss_of(model).item()
        E += eps * v
    return (up - down) / (2 * eps), float((g * v).sum())


def direction(model: nn.Module, rows: slice | list[int] = slice(None)) -> Tensor:
    """A random direction in E's space, non-zero on ``rows`` only."""
    gen = torch.Generator().manual_seed(1)
    E = model.get_parameter(EMB)
    v = torch.randn(E.shape, generator=gen, dtype=E.dtype)
    only = torch.zeros_like(v)
    only[rows] = v[rows]
    return only


def one_parameter(model: nn.Module) -> bool:
    named = dict(model.named_parameters(remove_duplicate=False))
    return named[EMB] is named[HEAD]


# --- correct ---------------------------------------------------------------------------------

def check_correct(name: str, rows: slice | list[int] = slice(None)) -> None:
    model = build(name)
    assert one_parameter(model)

    # the untying identity: dL/dE = dE_in + dE_out, each path non-vacuous
    d_in, d_out = untied(model)
    close(grad(model), d_in + d_out)
    assert float(d_in.abs().max()) > 1e-6 and float(d_out.abs().max()) > 1e-6

    close(micro_batched(model), grad(model))

    fd, analytic = directional(model, direction(model, rows))
    assert fd == pytest.approx(analytic, rel=1e-6, abs=1e-9)


def check_padding() -> None:
    # the backward agrees with the forward off the padding row only (see below)
    check_correct("nanogpt-padding", rows=slice(1, None))
    model = build("nanogpt-padding")
    assert (TOKENS == 0).sum() == 2
    d_in, d_out = untied(model)
    # token 0 is in the batch, yet padding_idx keeps its input path off row 0 ...
    assert torch.equal(d_in[0], torch.zeros_like(d_in[0]))
    # ... while the output path reaches it, and the tied gradient carries it
    assert float(d_out[0].abs().max()) > 1e-6
    close(grad(model)[0], d_out[0])
    # padding_idx stops the input path by design, though the forward reads row 0: along row 0
    # the loss moves as the unpadded model's gradient says, not as this one's
    v = direction(model, [0])
    fd, analytic = directional(model, v)
    _, unpadded = directional(twin(model, "nanogpt"), v)
    assert fd == pytest.approx(unpadded, rel=1e-6, abs=1e-9)
    assert abs(fd - analytic) > 1e-3 * abs(fd)


# --- broken ----------------------------------------------------------------------------------

def check_copy_tie(name: str) -> None:
    model = build(name)
    named = dict(model.named_parameters(remove_duplicate=False))
    E, H = named[EMB], named[HEAD]
    assert E is not H and torch.equal(E, H)
    if name.startswith("gpt2"):
        assert model.config.tie_word_embeddings  # the tie is declared, yet there are two
    # one SGD step moves each by its own path's gradient, so the "tie" comes apart
    d_in, d_out = untied(model)
    model.zero_grad()
    loss_of(model).backward()
    assert E.grad is not None and H.grad is not None
    close(E.grad, d_in)
    close(H.grad, d_out)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    far(E.detach(), H.detach())


def retie_by_assignment(model: nn.Module) -> None:
    model.get_submodule("transformer.wte").weight = model.get_submodule("lm_head").weight


def check_retie_clones() -> None:
    make = factory("nanogpt-retie-clones")
    torch.manual_seed(0)
    source = make()
    assert one_parameter(source)  # tied at construction, by nanoGPT's assignment

    # load_state_dict(assign=True) unties any tied module; the model's own tie_weights() then
    # must restore one Parameter, and this one makes a second
    for retie, stays_tied in ((retie_by_assignment, True),
                              (lambda m: m.tie_weights(), False)):
        loaded = make()
        loaded.load_state_dict(source.state_dict(), assign=True)
        assert not one_parameter(loaded)
        retie(loaded)
        assert one_parameter(loaded) is stays_tied
        named = dict(loaded.named_parameters(remove_duplicate=False))
        assert torch.equal(named[EMB], source.get_parameter(EMB))
        assert torch.equal(named[HEAD], source.get_parameter(EMB))

    for retie, stays_tied in ((retie_by_assignment, True),
                              (lambda m: m.tie_weights(), False)):
        with torch.device("meta"):
            empty = make()
        empty.to_empty(device="cpu")
        retie(empty)
        assert one_parameter(empty) is stays_tied


def check_resize_unties() -> None:
    correct, broken = build("gpt2"), build("gpt2-resize-unties")
    assert one_parameter(correct) and one_parameter(broken)
    for model, stays_tied in ((correct, True), (broken, False)):
        model.resize_token_embeddings(64, mean_resizing=False)
        assert one_parameter(model) is stays_tied
        assert model.get_parameter(EMB).shape == model.get_parameter(HEAD).shape == (64, 16)
        assert model.config.vocab_size == 64
        assert loss_of(model).isfinite()


def check_optimizer_both_names() -> None:
    target = builtin_target("nanogpt-optimizer-both-names")
    assert isinstance(target, TorchTarget) and target.optimizer is not None
    model = build("nanogpt-optimizer-both-names")
    assert one_parameter(model)  # the model is right; the optimizer is not
    E, wpe = model.get_parameter(EMB), model.get_parameter("transformer.wpe.weight")
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = target.optimizer(model)
    assert sum(p is E for g in opt.param_groups for p in g["params"]) == 2
    g = grad(model)
    assert wpe.grad is not None
    g_wpe, lr = wpe.grad.clone(), opt.param_groups[0]["lr"]
    E0, wpe0 = E.detach().clone(), wpe.detach().clone()
    opt.step()
    close(E.detach(), E0 - 2 * lr * g)  # the tied matrix: two updates
    close(wpe.detach(), wpe0 - lr * g_wpe)  # every other parameter: one


def test_transformers_loss_is_float32_in_a_float64_model() -> None:
    # why loss_of recomputes the GPT-2 loss: ForCausalLMLoss upcasts logits with .float()
    model = build("gpt2")
    out = model(input_ids=TOKENS, labels=TOKENS)
    assert out.logits.dtype == torch.float64 and out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(loss_of(model).item(), rel=1e-6)


def test_the_same_parameter_in_two_groups_is_refused() -> None:
    # why the built-in lists the tie twice in one group: torch refuses two groups outright
    model = build("nanogpt")
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.SGD([{"params": [model.get_parameter(EMB)]},
                         {"params": [model.get_parameter(HEAD)]}], lr=0.1)


def check_grad_assigned() -> None:
    model = build("nanogpt-grad-assigned")
    ref = twin(model)
    assert one_parameter(model)
    # one backward is right: the head assigns before the embedding's backward adds to it
    close(grad(model), grad(ref))
    # micro-batches are not: each assignment throws away what the previous ones left
    whole = micro_batched(ref)
    close(whole, grad(ref))
    accumulated = micro_batched(model)
    far(accumulated, whole)
    ref.zero_grad()
    (loss_of(ref, TOKENS[1:], TARGETS[1:]) / 2).backward()
    close(accumulated, ref.get_parameter(EMB).grad)  # only the last micro-batch survives


def check_embedding_no_accumulate() -> None:
    model = build("nanogpt-embedding-no-accumulate")
    ref = twin(model)
    g, g_ref = grad(model), grad(ref)
    absent = [r for r in range(g.size(0)) if r not in REPEATED]
    close(g[absent], g_ref[absent])  # tokens seen once and tokens absent: right
    for r in REPEATED:
        far(g[r], g_ref[r])

    # a repeated row holds the output path plus exactly one occurrence's dx
    dx: list[Tensor] = []

    def keep(_module: nn.Module, _inputs: Any, out: Tensor) -> None:
        out.retain_grad()
        dx.append(out)

    handle = ref.get_submodule("transformer.wte").register_forward_hook(keep)
    grad(ref)
    handle.remove()
    per_position = dx[0].grad
    assert per_position is not None
    _, d_out = untied(ref)
    flat_tokens, flat_dx = TOKENS.reshape(-1), per_position.reshape(-1, per_position.size(-1))
    for r in REPEATED:
        occurrences = flat_dx[flat_tokens == r]
        assert len(occurrences) >= 2
        assert any(torch.allclose(g[r], d_out[r] + o, rtol=RTOL, atol=ATOL)
                   for o in occurrences)


def check_padding_masked_both() -> None:
    model = build("nanogpt-padding-masked-both")
    ref = twin(model, "nanogpt-padding")
    g, g_ref = grad(model), grad(ref)
    assert torch.equal(g[0], torch.zeros_like(g[0]))  # the output path is gone from row 0 ...
    assert float(g_ref[0].abs().max()) > 1e-6  # ... where the correct padding model has it
    close(g[1:], g_ref[1:])


def check_grad_not_zeroed() -> None:
    model = build("nanogpt-grad-not-zeroed")
    ref = twin(model)
    first = grad(model)
    close(first, grad(ref))  # the first backward is right
    model.zero_grad()
    assert model.get_parameter(EMB).grad is None  # zero_grad() did clear .grad ...
    second = grad(model, OTHER_TOKENS, OTHER_TARGETS)
    own = grad(ref, OTHER_TOKENS, OTHER_TARGETS)
    close(second, first + own)  # ... yet the second carries the first along
    far(second, own)


def check_input_path_dropped() -> None:
    model = build("nanogpt-input-path-dropped")
    d_in, d_out = untied(twin(model))
    assert float(d_in.abs().max()) > 1e-6  # there is an input path to lose
    close(grad(model), d_out)


def check_custom_backward_wrong() -> None:
    model = build("nanogpt-custom-backward-wrong-both")
    ref = twin(model)
    # untying cannot see it: both uses go through the model's own backward
    d_in, d_out = untied(model)
    close(grad(model), d_in + d_out)
    # the loss can: its directional derivative matches the correct gradient, not this one
    v = direction(model)
    fd, analytic = directional(model, v)
    _, right = directional(ref, v)
    assert fd == pytest.approx(right, rel=1e-6, abs=1e-9)
    assert abs(fd - analytic) > 1e-3 * abs(fd)
    _, ref_out = untied(ref)
    close(d_out, 0.5 * ref_out)


CHECKS: dict[str, Callable[[], None]] = {
    "nanogpt": lambda: check_correct("nanogpt"),
    "gpt2": lambda: check_correct("gpt2"),
    "nanogpt-padding": check_padding,
    "nanogpt-copy-tie": lambda: check_copy_tie("nanogpt-copy-tie"),
    "gpt2-copy-tie": lambda: check_copy_tie("gpt2-copy-tie"),
    "nanogpt-retie-clones": check_retie_clones,
    "gpt2-resize-unties": check_resize_unties,
    "nanogpt-optimizer-both-names": check_optimizer_both_names,
    "nanogpt-grad-assigned": check_grad_assigned,
    "nanogpt-embedding-no-accumulate": check_embedding_no_accumulate,
    "nanogpt-padding-masked-both": check_padding_masked_both,
    "nanogpt-grad-not-zeroed": check_grad_not_zeroed,
    "nanogpt-input-path-dropped": check_input_path_dropped,
    "nanogpt-custom-backward-wrong-both": check_custom_backward_wrong,
}


@pytest.mark.parametrize("name", list(TORCH_BUILTINS))
def test_builtin_shows_its_defining_behaviour(name: str) -> None:
    CHECKS[name]()


# --- the table -------------------------------------------------------------------------------

def test_every_builtin_has_a_check() -> None:
    assert set(CHECKS) == set(TORCH_BUILTINS)


@pytest.mark.parametrize("name", list(TORCH_BUILTINS))
def test_table_entry_is_consistent(name: str) -> None:
    b = TORCH_BUILTINS[name]
    assert b.name == name
    assert b.expected in LABELS
    assert (b.breaks is None) == (b.expected == "correct")
    target = builtin_target(name)
    assert isinstance(target, TorchTarget) or callable(target)


@pytest.mark.parametrize("name", list(TORCH_BUILTINS))
def test_factories_are_fresh_and_seeded(name: str) -> None:
    make = factory(name)
    torch.manual_seed(3)
    a = make()
    torch.manual_seed(3)
    b = make()
    assert a is not b
    assert all(p is not q for p, q in zip(a.parameters(), b.parameters()))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_unknown_name_is_refused() -> None:
    with pytest.raises(KeyError, match="no torch built-in named 'nope'"):
        builtin_target("nope")


def test_importing_needs_neither_torch_nor_transformers() -> None:
    # transformers blocked: the zoo imports without torch, and the nanogpt built-ins still build
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import tyingspec._src.kinds.torch.zoo as z\n"
            "assert 'torch' not in sys.modules\n"
            "assert 'gpt2' in z.TORCH_BUILTINS\n"
            "z.nanogpt(); z.nanogpt_grad_not_zeroed()\n")
    subprocess.run([sys.executable, "-c", code], check=True)
