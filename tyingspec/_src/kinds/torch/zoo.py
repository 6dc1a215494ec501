"""Built-in PyTorch targets for the torch kind: tiny tied language models, correct and broken.

Every built-in is a zero-argument factory returning a fresh ``nn.Module`` (or a
:class:`~kinds.torch.target.TorchTarget` around one), small enough to run on a CPU in
milliseconds and deterministic given ``torch.manual_seed``.  The broken ones are each one small,
realistic deviation from ``nanogpt`` (or ``gpt2``), written as a subclass that changes one
thing, and :data:`TORCH_BUILTINS` records the invariant each breaks (catalogue names as in
:mod:`kinds.probe.mutants`) and the label a check must reach.

Where a bug sits decides what a checker can observe, so it is placed deliberately: the
delayed-wgrad heads, the non-accumulating lookup and the padding mask live *inside* custom
``nn.Linear``/``nn.Embedding`` subclasses at ``lm_head``/``transformer.wte`` (forward hooks
there still see every plain lookup and head call), while the halving fused head and the
detached lookup bypass those modules, as fused kernels and detached reads do.

Two caveats for whoever judges them (both pinned in ``tests/kinds/torch/test_torch_zoo.py``):
``nanogpt-padding`` is correct, yet along row 0 its gradient disagrees with central differences
of its loss, because ``padding_idx`` stops the input path that the forward does use; and
transformers' GPT-2 loss (``ForCausalLMLoss``) casts the logits to float32 even in a float64
model, so differencing ``.loss`` measures float32 rounding.

Importing this module imports neither torch nor transformers: listing the built-ins stays cheap
(and works without the ``torch`` extra).  torch is imported by the first factory call, and
transformers only by the ``gpt2`` factories.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tyingspec._src.kinds.torch.target import TorchTarget

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel, PreTrainedModel

__all__ = ["TORCH_BUILTINS", "TorchBuiltin", "builtin_target"]


@dataclass(frozen=True)
class TorchBuiltin:
    """One built-in torch target: its name, what it breaks and the label a check must reach."""

    name: str  # e.g. "nanogpt", "nanogpt-copy-tie"
    attr: str  # this module's attribute holding the factory or TorchTarget
    description: str
    breaks: str | None  # the invariant it breaks; None when correct
    expected: str  # the Label a check must reach ("correct" for correct ones)


@dataclass(frozen=True)
class _GPTConfig:
    vocab_size: int = 61  # not a power of two, so nothing can lean on V being one
    block_size: int = 8
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True
    padding_idx: int | None = None


_PAD = 0  # the padding row of the padding variants


# --- nanoGPT and its variants ----------------------------------------------------------------
# The classes are built on first use so that importing this module does not import torch.

@functools.cache
def _nanogpt_classes() -> dict[str, type[nn.Module]]:
    import torch
    from torch import Tensor, nn
    from torch.nn import functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self, c: _GPTConfig) -> None:
            super().__init__()
            self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
            self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
            self.n_head = c.n_head

        def forward(self, x: Tensor) -> Tensor:
            B, T, C = x.size()
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                       for t in self.c_attn(x).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return cast(Tensor, self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    class MLP(nn.Module):
        def __init__(self, c: _GPTConfig) -> None:
            super().__init__()
            self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

        def forward(self, x: Tensor) -> Tensor:
            return cast(Tensor, self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self, c: _GPTConfig) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
            self.attn = CausalSelfAttention(c)
            self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
            self.mlp = MLP(c)

        def forward(self, x: Tensor) -> Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + cast(Tensor, self.mlp(self.ln_2(x)))

    class GPT(nn.Module):
        # nanoGPT's GPT (karpathy/nanoGPT model.py), cut down.  The broken variants change one
        # thing: the class of the token embedding or of the head (a custom module, so forward
        # hooks on transformer.wte and lm_head still see every lookup and every head call), or
        # `embed`/`head`, where a use bypasses those modules altogether.
        embedding_cls: type[nn.Embedding] = nn.Embedding
        head_cls: type[nn.Linear] = nn.Linear

        def __init__(self, c: _GPTConfig) -> None:
            super().__init__()
            self.config = c
            wte = self.embedding_cls(c.vocab_size, c.n_embd, padding_idx=c.padding_idx)
            self.transformer = nn.ModuleDict(dict(
                wte=wte,
                wpe=nn.Embedding(c.block_size, c.n_embd),
                drop=nn.Dropout(c.dropout),
                h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
                ln_f=nn.LayerNorm(c.n_embd, bias=c.bias)))
            self.lm_head = self.head_cls(c.n_embd, c.vocab_size, bias=False)
            wte.weight = self.lm_head.weight  # nanoGPT's tie: one Parameter under two names
            self.apply(self._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

        @staticmethod
        def _init_weights(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

        @property
        def wte(self) -> nn.Embedding:
            return cast(nn.Embedding, self.transformer["wte"])

        def embed(self, idx: Tensor) -> Tensor:
            return cast(Tensor, self.wte(idx))

        def head(self, x: Tensor) -> Tensor:
            return cast(Tensor, self.lm_head(x))

        def forward(self, idx: Tensor,
                    targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
            pos = torch.arange(idx.size(1), device=idx.device)
            x = self.transformer["drop"](self.embed(idx) + self.transformer["wpe"](pos))
            for block in cast(nn.ModuleList, self.transformer["h"]):
                x = block(x)
            logits = self.head(self.transformer["ln_f"](x))
            if targets is None:
                return logits, None
            # nanoGPT's loss: mean cross-entropy over every position of the batch
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
            return logits, loss

    class CopyTie(GPT):
        def __init__(self, c: _GPTConfig) -> None:
            super().__init__(c)
            # the bug: the head gets a Parameter of its own holding the embedding's values
            self.lm_head.weight = nn.Parameter(self.wte.weight.detach().clone())

    class RetieClones(GPT):
        def tie_weights(self) -> None:
            # the bug: re-ties by value, so after a load with assign=True or to_empty() the
            # two names hold two Parameters (tied at construction by nanoGPT's assignment)
            self.lm_head.weight = nn.Parameter(self.wte.weight.detach().clone())

    class DelayedWgradHead(torch.autograd.Function):
        # logits = h @ W.T with a hand-written backward that computes the weight gradient
        # itself (delayed-wgrad style) and hands it to `take(weight, wgrad)`, whose return
        # value is what autograd accumulates for W (None: autograd adds nothing)

        @staticmethod
        def forward(ctx: Any, h: Tensor, weight: Tensor,
                    take: Callable[[Tensor, Tensor], Tensor | None]) -> Tensor:
            ctx.save_for_backward(h)
            # the Parameter object itself, not a saved copy: `take` may set its .grad
            ctx.weight, ctx.take = weight, take
            return h @ weight.T

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor | None, None]:
            (h,) = ctx.saved_tensors
            weight: Tensor = ctx.weight
            wgrad = g.flatten(0, -2).T @ h.flatten(0, -2)
            return g @ weight, ctx.take(weight, wgrad), None

    class DelayedWgradLinear(nn.Linear):
        # a bias-free head layer in the style of TransformerEngine/Megatron linears; the
        # subclasses below differ in what they do with the weight gradient
        def forward(self, x: Tensor) -> Tensor:
            out = DelayedWgradHead.apply(  # type: ignore[no-untyped-call]
                x, self.weight, self.take_wgrad)
            return cast(Tensor, out)

        def take_wgrad(self, weight: Tensor, wgrad: Tensor) -> Tensor | None:
            return wgrad

    class AssigningLinear(DelayedWgradLinear):
        def take_wgrad(self, weight: Tensor, wgrad: Tensor) -> Tensor | None:
            # the bug: `=` where autograd would `+=`.  Within one backward the total is still
            # right (this head runs before the embedding's backward, whose input path autograd
            # then adds to .grad), but it discards what earlier micro-batches left in .grad.
            weight.grad = wgrad
            return None

    class BufferedLinear(DelayedWgradLinear):
        wgrad: Tensor

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.register_buffer("wgrad", torch.zeros_like(self.weight), persistent=False)

        def take_wgrad(self, weight: Tensor, wgrad: Tensor) -> Tensor | None:
            # the bug: a persistent buffer accumulated into and never reset, since zero_grad()
            # only drops .grad.  .grad is the buffer itself (not a copy of it), so autograd adds
            # the input path into it too and the second backward after zero_grad() returns
            # exactly the first one's gradient plus its own; a copy would carry over only the
            # first output path.  zero_grad(set_to_none=False) zeroes it through .grad and
            # hides the bug; the default set_to_none=True does not.
            self.wgrad += wgrad
            weight.grad = self.wgrad
            return None

    class GradAssigned(GPT):
        head_cls = AssigningLinear

    class GradNotZeroed(GPT):
        head_cls = BufferedLinear

    class HalfWgrad(GPT):
        # A fused head (as fused linear-cross-entropy kernels do) takes lm_head.weight itself,
        # bypassing the lm_head module, so no hook on that module sees h or g.
        def head(self, x: Tensor) -> Tensor:
            out = DelayedWgradHead.apply(  # type: ignore[no-untyped-call]
                x, self.lm_head.weight, self.halved_wgrad)
            return cast(Tensor, out)

        @staticmethod
        def halved_wgrad(weight: Tensor, wgrad: Tensor) -> Tensor | None:
            # the bug: the backward halves the head's weight gradient (as if averaging the two
            # uses).  Untying cannot show it (both uses go through this same backward); the
            # reference built from the Function's observed output, and the loss itself
            # differenced along a direction, both contradict it.
            return 0.5 * wgrad

    class LookupNoAccumulate(torch.autograd.Function):
        # an embedding lookup whose backward writes rows with index_put_(accumulate=False):
        # a token seen k times keeps one occurrence's gradient, not the sum of k

        @staticmethod
        def forward(ctx: Any, weight: Tensor, idx: Tensor) -> Tensor:
            ctx.save_for_backward(idx)
            ctx.rows = weight.size(0)
            return F.embedding(idx, weight)

        @staticmethod
        def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
            (idx,) = ctx.saved_tensors
            d = dy.size(-1)
            dw = dy.new_zeros(ctx.rows, d)
            dw.index_put_((idx.reshape(-1),), dy.reshape(-1, d), accumulate=False)
            return dw, None

    class NoAccumulateEmbedding(nn.Embedding):
        def forward(self, idx: Tensor) -> Tensor:
            out = LookupNoAccumulate.apply(self.weight, idx)  # type: ignore[no-untyped-call]
            return cast(Tensor, out)

    class EmbeddingNoAccumulate(GPT):
        embedding_cls = NoAccumulateEmbedding

    class InputPathDropped(GPT):
        def embed(self, idx: Tensor) -> Tensor:
            # the bug: the lookup reads a detached weight, so the input path never reaches it
            return self.wte.weight.detach()[idx]

    class ZeroRowGrad(torch.autograd.Function):
        # identity on the weight; its backward zeroes one row of the gradient

        @staticmethod
        def forward(ctx: Any, weight: Tensor, row: int) -> Tensor:
            ctx.row = row
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            return g.index_fill(0, torch.tensor([ctx.row], device=g.device), 0.0), None

    def masked(weight: Tensor) -> Tensor:
        return cast(Tensor, ZeroRowGrad.apply(weight, _PAD))  # type: ignore[no-untyped-call]

    # the bug: "keep the pad row fixed" by zeroing its gradient on the tied matrix, which also
    # removes the output path from row 0.  The usual form is weight.register_hook(...) on the
    # Parameter, but copy.deepcopy, load_state_dict(assign=True) and to_empty() make new
    # Parameters without the hook, so the bug would vanish from every copy; masking the weight
    # inside both modules' forward survives all of them.
    class PadMaskedEmbedding(nn.Embedding):
        def forward(self, idx: Tensor) -> Tensor:
            return F.embedding(idx, masked(self.weight), padding_idx=self.padding_idx)

    class PadMaskedLinear(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return F.linear(x, masked(self.weight), self.bias)

    class PaddingMaskedBoth(GPT):
        embedding_cls = PadMaskedEmbedding
        head_cls = PadMaskedLinear

    return {"GPT": GPT, "CopyTie": CopyTie, "RetieClones": RetieClones,
            "GradAssigned": GradAssigned, "GradNotZeroed": GradNotZeroed,
            "HalfWgrad": HalfWgrad, "EmbeddingNoAccumulate": EmbeddingNoAccumulate,
            "InputPathDropped": InputPathDropped, "PaddingMaskedBoth": PaddingMaskedBoth}


def _nano(cls: str, **config: Any) -> nn.Module:
    return _nanogpt_classes()[cls](_GPTConfig(**config))


def nanogpt() -> nn.Module:
    """nanoGPT (V=61, block 8, 2 pre-LN blocks, n_embd 16, 2 heads, no dropout), tied by
    ``transformer.wte.weight = lm_head.weight``; ``forward(idx, targets)`` returns
    ``(logits, loss)`` with the mean cross-entropy over every position.  Correct."""
    return _nano("GPT")


def nanogpt_padding() -> nn.Module:
    """nanoGPT with ``wte = nn.Embedding(V, d, padding_idx=0)``, tie kept.  Correct: padding_idx
    keeps the input path off row 0, the output path still reaches it.  (The forward still reads
    row 0, so along row 0 the gradient is not the loss's derivative, by padding_idx's design.)"""
    return _nano("GPT", padding_idx=_PAD)


def nanogpt_copy_tie() -> nn.Module:
    """nanoGPT whose head is ``nn.Parameter(wte.weight.detach().clone())``: two Parameters with
    equal values, so each is stepped with its own path's gradient."""
    return _nano("CopyTie")


def nanogpt_retie_clones() -> nn.Module:
    """nanoGPT, tied at construction, with a ``tie_weights()`` that clones instead of
    assigning: after ``load_state_dict(assign=True)`` or meta-device init + ``to_empty()``,
    re-tying leaves two Parameters."""
    return _nano("RetieClones")


def nanogpt_grad_assigned() -> nn.Module:
    """nanoGPT whose ``lm_head`` is a delayed-wgrad linear (a custom ``autograd.Function``)
    that assigns ``weight.grad = g.T @ h``: one backward is right, but micro-batches do not
    accumulate."""
    return _nano("GradAssigned")


def nanogpt_embedding_no_accumulate() -> nn.Module:
    """nanoGPT whose ``wte`` is an embedding whose backward uses
    ``index_put_(accumulate=False)``: a repeated token keeps one occurrence's input-path
    gradient."""
    return _nano("EmbeddingNoAccumulate")


def nanogpt_padding_masked_both() -> nn.Module:
    """``nanogpt_padding`` with row 0 of the whole tied gradient zeroed, so the output path is
    masked off the padding row too."""
    return _nano("PaddingMaskedBoth", padding_idx=_PAD)


def nanogpt_grad_not_zeroed() -> nn.Module:
    """nanoGPT whose delayed-wgrad ``lm_head`` accumulates into a persistent buffer, which is
    its weight's ``.grad`` and which ``zero_grad()`` never resets: the second backward after
    ``zero_grad()`` returns the first one's gradient plus its own."""
    return _nano("GradNotZeroed")


def nanogpt_input_path_dropped() -> nn.Module:
    """nanoGPT whose lookup is ``wte.weight.detach()[idx]``: the input path never reaches the
    tied gradient."""
    return _nano("InputPathDropped")


def nanogpt_custom_backward_wrong_both() -> nn.Module:
    """nanoGPT whose head is a fused ``autograd.Function`` (logits = h @ E.T, taking
    ``lm_head.weight`` directly) returning half the weight gradient: consistent with its own
    backward (untying agrees).  The Function's output is ``h @ E.T``, so the check records ``h``
    and ``g`` there and the rows name the output path halved; finite differences of the forward
    contradict it too."""
    return _nano("HalfWgrad")


def _sgd_over_both_names(model: nn.Module) -> torch.optim.Optimizer:
    import torch

    # What torch 2.13.0 does with the tied Parameter listed under both its names in one group:
    # it warns ("optimizer contains a parameter group with duplicate parameters; in future,
    # this will cause an error", pytorch #40967) and then steps it twice: exactly two SGD
    # updates, with or without foreach, and with momentum (one shared state slot, applied
    # twice).  Putting the two names in two groups instead raises ValueError ("some parameters
    # appear in more than one parameter group"), so this is the form that reaches training.
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    return torch.optim.SGD(params, lr=0.1)


#: nanoGPT trained by an SGD built from ``named_parameters(remove_duplicate=False)``: the tied
#: Parameter is in the group twice and each step moves it by two updates.
nanogpt_optimizer_both_names = TorchTarget(model=nanogpt, optimizer=_sgd_over_both_names)


# --- GPT-2 (transformers) --------------------------------------------------------------------

def _gpt2_config() -> Any:
    from transformers import GPT2Config

    # bos/eos given explicitly: GPT2Config's defaults (50256) lie outside a 61-token vocabulary
    return GPT2Config(vocab_size=61, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                      eos_token_id=0, tie_word_embeddings=True)


def _quiet_loss(model: PreTrainedModel) -> PreTrainedModel:
    # transformers 5 derives the loss type from the class name, finds none in
    # "GPT2LMHeadModel" and warns on the first loss before falling back to ForCausalLM; naming
    # that default silences the warning and changes nothing
    model.loss_type = "ForCausalLM"
    return model


def gpt2() -> nn.Module:
    """transformers' ``GPT2LMHeadModel`` (V=61, 8 positions, 1 layer, n_embd 16, 2 heads, no
    dropout), tied by transformers itself.  Correct.  Its ``.loss`` is float32 whatever the
    model's dtype (``ForCausalLMLoss`` upcasts the logits with ``.float()``)."""
    from transformers import GPT2LMHeadModel

    return _quiet_loss(GPT2LMHeadModel(_gpt2_config()))


def gpt2_copy_tie() -> nn.Module:
    """``gpt2`` with ``tie_word_embeddings=True`` declared, but the head given its own cloned
    Parameter after construction: a declared tie over two Parameters."""
    from torch import nn

    model = gpt2()
    wte = cast(nn.Embedding, model.get_submodule("transformer.wte"))
    lm_head = cast(nn.Linear, model.get_submodule("lm_head"))
    lm_head.weight = nn.Parameter(wte.weight.detach().clone())
    return model


@functools.cache
def _gpt2_resize_unties_class() -> type[GPT2LMHeadModel]:
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel

    class GPT2ResizeUnties(GPT2LMHeadModel):  # type: ignore[no-untyped-call]
        def resize_token_embeddings(self, new_num_tokens: int | None = None,
                                    pad_to_multiple_of: int | None = None,
                                    mean_resizing: bool = True) -> nn.Embedding:
            old = cast(nn.Embedding, self.get_input_embeddings())
            n = old.num_embeddings if new_num_tokens is None else new_num_tokens
            if pad_to_multiple_of is not None:
                n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
            new = nn.Embedding(n, old.embedding_dim, device=old.weight.device,
                               dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.normal_(0.0, self.config.initializer_range)
                kept = min(n, old.num_embeddings)
                new.weight[:kept] = old.weight[:kept]
            self.set_input_embeddings(new)
            # the bug: the head is rebuilt with a Parameter of its own and never re-tied
            head = nn.Linear(old.embedding_dim, n, bias=False, device=new.weight.device,
                             dtype=new.weight.dtype)
            head.weight = nn.Parameter(new.weight.detach().clone())
            self.set_output_embeddings(head)  # type: ignore[no-untyped-call]
            self.config.vocab_size = n
            return new

    return GPT2ResizeUnties


def gpt2_resize_unties() -> nn.Module:
    """``gpt2`` whose ``resize_token_embeddings`` resizes the input embeddings but gives the
    head a new, separate Parameter: tied at construction, untied by a resize."""
    return _quiet_loss(_gpt2_resize_unties_class()(_gpt2_config()))


# --- the table -------------------------------------------------------------------------------

TORCH_BUILTINS: dict[str, TorchBuiltin] = {b.name: b for b in [
    TorchBuiltin("nanogpt", "nanogpt",
                 "nanoGPT GPT, tied by assignment (wte.weight = lm_head.weight)",
                 None, "correct"),
    TorchBuiltin("gpt2", "gpt2", "transformers GPT2LMHeadModel, tied by transformers",
                 None, "correct"),
    TorchBuiltin("nanogpt-padding", "nanogpt_padding",
                 "nanoGPT with padding_idx=0: no input path on row 0, output path on it",
                 None, "correct"),
    TorchBuiltin("nanogpt-copy-tie", "nanogpt_copy_tie",
                 "head = nn.Parameter(wte.weight.detach().clone()): two Parameters, equal values",
                 "ID", "tie_is_a_copy"),
    TorchBuiltin("gpt2-copy-tie", "gpt2_copy_tie",
                 "GPT-2 declaring tie_word_embeddings=True, head given a cloned Parameter",
                 "ID", "tie_is_a_copy"),
    TorchBuiltin("nanogpt-retie-clones", "nanogpt_retie_clones",
                 "tie_weights() clones: the tie is lost after load(assign=True) or to_empty()",
                 "ID", "tie_lost"),
    TorchBuiltin("gpt2-resize-unties", "gpt2_resize_unties",
                 "resize_token_embeddings gives the head a new, separate Parameter",
                 "ID", "tie_lost"),
    TorchBuiltin("nanogpt-optimizer-both-names", "nanogpt_optimizer_both_names",
                 "SGD over named_parameters(remove_duplicate=False): the tie stepped twice",
                 "ID", "optimizer_sees_tie_twice"),
    TorchBuiltin("nanogpt-grad-assigned", "nanogpt_grad_assigned",
                 "delayed-wgrad head assigns weight.grad = g.T @ h: micro-batches are lost",
                 "SUM", "gradient_assigned"),
    TorchBuiltin("nanogpt-embedding-no-accumulate", "nanogpt_embedding_no_accumulate",
                 "lookup backward index_put_(accumulate=False): repeated tokens keep one",
                 "DUP", "duplicates_not_accumulated"),
    TorchBuiltin("nanogpt-padding-masked-both", "nanogpt_padding_masked_both",
                 "padding_idx=0 plus row 0 of the tied gradient zeroed: output path masked too",
                 "PAD", "padding_row_masked"),
    TorchBuiltin("nanogpt-grad-not-zeroed", "nanogpt_grad_not_zeroed",
                 "delayed-wgrad head's persistent buffer survives zero_grad()",
                 "FRESH", "gradient_not_zeroed"),
    TorchBuiltin("nanogpt-input-path-dropped", "nanogpt_input_path_dropped",
                 "lookup from wte.weight.detach(): the input path never reaches the gradient",
                 "SUM/ROWS", "input_path_missing"),
    TorchBuiltin("nanogpt-custom-backward-wrong-both", "nanogpt_custom_backward_wrong_both",
                 "custom head Function's backward halves the weight gradient: output path "
                 "halved", "SCALE", "path_scaled"),
]}


def builtin_target(name: str) -> Any:
    """The factory or :class:`TorchTarget` of the built-in called ``name``."""
    if name not in TORCH_BUILTINS:
        raise KeyError(f"no torch built-in named {name!r}; known: {', '.join(TORCH_BUILTINS)}")
    return globals()[TORCH_BUILTINS[name].attr]
