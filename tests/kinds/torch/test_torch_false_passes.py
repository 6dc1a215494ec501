"""The torch kind on wrong models whose bug shows only on the path that trains (issue 18 §1).

Each model is a realistic bug that a check run the easy way would pass: only in train() mode,
only in float32, only past 16 positions or beyond the first sequence, only after a few
optimizer steps, only with one sequence per batch, or in the model's own loss.  Each must make
``tyingspec check --kind torch`` exit 1, with the label its bug has where the catalogue names
one.

Each model is the source of a small module (V 37-61, d 8-16, one block) written into
``tmp_path`` under a name of its own, checked in a worker process as a user's
``module:make_model`` is.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch_sources
from torch_sources import shapes, summary

from tyingspec._src.front.check import CheckReport

#: the shared prelude, and a tiny GPT whose `embed` and `head` a subclass changes
PRELUDE = torch_sources.PRELUDE + textwrap.dedent('''
    class TinyGPT(nn.Module):
        """token and position lookups, one block, a tied head; `embed` and `head` are the two
        uses a subclass changes."""

        def __init__(self, block_size=T):
            super().__init__()
            self.block_size = block_size
            self.wte = nn.Embedding(V, D)
            self.pos_emb = nn.Embedding(block_size, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def embed(self, idx):
            return self.wte(idx)

        def head(self, h):
            return self.lm_head(h)

        def forward(self, idx):
            x = self.embed(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            return self.head(self.body(x))
''')


def check(tmp_path: Path, module: str, source: str, attr: str = "make_model",
          only: str | None = None) -> CheckReport:
    return torch_sources.check(tmp_path, module, source, attr, prelude=PRELUDE, only=only)


def assert_wrong(rep: CheckReport, *labels: str) -> None:
    """Exit 1; with ``labels``, the report's diagnosis is one of them, else any real label."""
    assert rep.load_error is None, summary(rep)
    assert rep.exit_code == 1, summary(rep)
    if labels:
        assert rep.diagnosis_label in labels, summary(rep)
    else:
        assert rep.diagnosis_label not in ("correct", "adapter_error", "no_power"), summary(rep)


def failed_checks(rep: CheckReport) -> dict[str, set[str]]:
    """check name -> the labels it failed with, over every case."""
    out: dict[str, set[str]] = {}
    for r in rep.results:
        for f in r.diagnosis.findings if r.diagnosis else ():
            if f.outcome == "failed":
                out.setdefault(f.check, set()).add(str(f.label))
    return out


# --- 1: only in training mode ----------------------------------------------------------------

TRAINING_ONLY_HEAD = '''
    class FusedHead(torch.autograd.Function):
        """h @ W.T with a hand-written backward: the weight gradient halved (as if the two uses
        of a tied weight were averaged)."""

        @staticmethod
        def forward(ctx, h, weight):
            ctx.save_for_backward(h, weight)
            return h @ weight.T

        @staticmethod
        def backward(ctx, g):
            h, weight = ctx.saved_tensors
            grad_w = g.flatten(0, -2).T @ h.flatten(0, -2)
            return g @ weight, grad_w * 0.5


    class TrainingFused(TinyGPT):
        def head(self, h):
            if self.training:  # the fused kernel is for training; eval uses the plain head
                return FusedHead.apply(h, self.lm_head.weight)
            return self.lm_head(h)


    def make_model():
        return TrainingFused()
'''


def test_a_fused_head_taken_only_in_training_mode(tmp_path: Path) -> None:
    # every row is wrong (the output path is halved): one case costs the forward check's whole
    # budget, and one is enough
    rep = check(tmp_path, "fp_training_only_head", TRAINING_ONLY_HEAD, only="repeated-tokens")
    assert_wrong(rep)
    assert "gradient against the forward" in failed_checks(rep), summary(rep)


# --- 2: the model's own loss -----------------------------------------------------------------

WRONG_LOSS_TARGETS = '''
    class PerSequenceLoss(TinyGPT):
        """Sums token cross-entropy and divides by the number of sequences, not of tokens."""

        def forward(self, idx, targets=None):
            logits = super().forward(idx)
            if targets is None:
                return logits, None
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            return logits, loss / idx.shape[0]


    def make_model():
        return PerSequenceLoss()
'''

WRONG_LOSS_LABELS = '''
    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits


    class PerSequenceLabels(TinyGPT):
        """transformers-style forward(input_ids, labels): shifts the labels, then sums token
        cross-entropy over the batch and divides by the number of sequences."""

        def forward(self, input_ids, labels=None):
            logits = super().forward(input_ids)
            loss = None
            if labels is not None:
                shift_logits = logits[:, :-1].flatten(0, 1)
                shift_labels = labels[:, 1:].flatten()
                loss = F.cross_entropy(shift_logits, shift_labels, reduction="sum")
                loss = loss / input_ids.shape[0]
            return Output(loss, logits)


    def make_model():
        return PerSequenceLabels()
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module, source", [("fp_loss_targets", WRONG_LOSS_TARGETS),
                                            ("fp_loss_labels", WRONG_LOSS_LABELS)],
                         ids=["forward-targets", "forward-labels"])
def test_the_models_own_loss_divided_by_sequences_not_tokens(tmp_path: Path, module: str,
                                                             source: str) -> None:
    # loss and gradient agree with each other (the gradient is that of the loss returned);
    # what is wrong is the loss: T times the mean token cross-entropy
    rep = check(tmp_path, module, source)
    assert_wrong(rep, "loss_misnormalised")
    assert "loss is the mean token cross-entropy" in failed_checks(rep), summary(rep)


# --- 3: only in float32 ----------------------------------------------------------------------

FLOAT32_ONLY = '''
    class Lookup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape, ctx.dtype = weight.shape, weight.dtype
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            flat_ids, flat_dy = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
            grad = dy.new_zeros(ctx.shape)
            if ctx.dtype == torch.float32:
                # the "fast" float32 kernel: one write per row, repeated tokens lost
                grad.index_put_((flat_ids,), flat_dy, accumulate=False)
            else:
                grad.index_add_(0, flat_ids, flat_dy)
            return grad, None


    class Float32Only(TinyGPT):
        def embed(self, idx):
            return Lookup.apply(self.wte.weight, idx)


    def make_model():
        return Float32Only()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_duplicates_dropped_only_in_float32(tmp_path: Path) -> None:
    rep = check(tmp_path, "fp_float32_only", FLOAT32_ONLY)
    assert_wrong(rep, "duplicates_not_accumulated")


# --- 4: only past 16 positions, only beyond the first sequence ------------------------------

CHUNKED = '''
    class Lookup(torch.autograd.Function):
        """A chunked lookup kernel whose backward covers only part of the batch."""

        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape = weight.shape
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            ids, dy = KEEP(ids), KEEP(dy)  # the bug: only the first chunk is scattered
            grad = dy.new_zeros(ctx.shape)
            grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
            return grad, None


    class Chunked(TinyGPT):
        def __init__(self):
            super().__init__(block_size=32)

        def embed(self, idx):
            return Lookup.apply(self.wte.weight, idx)


    def make_model():
        return Chunked()
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module, keep", [
    ("fp_first_16_positions", "lambda t: t[:, :16]"),
    ("fp_first_sequence", "lambda t: t[:1]")], ids=["positions-past-16", "sequences-past-1"])
def test_a_lookup_backward_that_covers_part_of_the_batch(tmp_path: Path, module: str,
                                                         keep: str) -> None:
    rep = check(tmp_path, module, f"KEEP = {keep}\n" + textwrap.dedent(CHUNKED))
    assert_wrong(rep)
    assert (16, 32) in shapes(rep), summary(rep)  # the whole context, many sequences


# --- 5: only after a few steps ---------------------------------------------------------------

AFTER_STEPS = '''
    class NoAccumulate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape = weight.shape
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            grad = dy.new_zeros(ctx.shape)
            grad[ids.reshape(-1)] = dy.reshape(-1, dy.shape[-1])  # last copy wins
            return grad, None


    class WarmedUp(TinyGPT):
        """An autotuner-style switch: after three training forwards the lookup takes a
        "faster" kernel whose backward does not accumulate repeated tokens."""

        def __init__(self):
            super().__init__()
            self.training_forwards = 0

        def embed(self, idx):
            if self.training:
                self.training_forwards += 1
            if self.training_forwards > 3:
                return NoAccumulate.apply(self.wte.weight, idx)
            return self.wte(idx)


    def make_model():
        return WarmedUp()
'''


def test_a_lookup_that_stops_accumulating_after_three_training_forwards(tmp_path: Path) -> None:
    rep = check(tmp_path, "fp_after_steps", AFTER_STEPS)
    assert_wrong(rep, "duplicates_not_accumulated")
    assert "gradient at every training step" in failed_checks(rep), summary(rep)


# --- 6: one sequence per batch ---------------------------------------------------------------

ONE_SEQUENCE = '''
    class AssigningWgrad(torch.autograd.Function):
        """TransformerEngine #3437: the delayed weight gradient is assigned, not added."""

        @staticmethod
        def forward(ctx, h, weight):
            ctx.save_for_backward(h)
            ctx.weight = weight
            return h @ weight.T

        @staticmethod
        def backward(ctx, g):
            (h,) = ctx.saved_tensors
            weight = ctx.weight
            weight.grad = g.flatten(0, -2).T @ h.flatten(0, -2)  # the bug: `=` not `+=`
            return g @ weight, None


    class Assigning(TinyGPT):
        def head(self, h):
            return AssigningWgrad.apply(h, self.lm_head.weight)


    make_model = TorchTarget(model=Assigning, batch_size=1)
'''


def test_an_assigned_wgrad_with_one_sequence_per_batch(tmp_path: Path) -> None:
    rep = check(tmp_path, "fp_one_sequence", ONE_SEQUENCE)
    assert_wrong(rep, "gradient_assigned")
    assert {B for B, _ in shapes(rep)} == {1}, summary(rep)


# --- 7: a detached lookup in a transformers GPT-2 --------------------------------------------

DETACHED_GPT2 = '''
    from transformers import GPT2Config, GPT2LMHeadModel


    class DetachedEmbedding(nn.Embedding):
        def forward(self, input_ids):
            # the bug: the lookup reads a detached weight, so the input path never reaches E
            return F.embedding(input_ids, self.weight.detach())


    def make_model():
        config = GPT2Config(vocab_size=53, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                            tie_word_embeddings=True)
        model = GPT2LMHeadModel(config)
        wte = DetachedEmbedding(config.vocab_size, config.n_embd)
        wte.weight = model.transformer.wte.weight
        model.transformer.wte = wte
        assert model.lm_head.weight is model.transformer.wte.weight
        return model
'''


@pytest.mark.slow
def test_a_detached_lookup_in_a_transformers_gpt2(tmp_path: Path) -> None:
    rep = check(tmp_path, "fp_detached_gpt2", DETACHED_GPT2)
    assert_wrong(rep, "input_path_missing")


# --- a pattern of rows that the tie's sum does not explain -----------------------------------

DILUTED_UPSTREAM = '''
    class Diluted(torch.autograd.Function):
        """The identity forward; the backward divides each position's gradient by how often its
        token occurs in the batch: the gradient reaching the lookup is wrong, and most wrong
        on repeated tokens, while the tie sums every use it receives."""

        @staticmethod
        def forward(ctx, x, idx):
            ctx.save_for_backward(idx)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (idx,) = ctx.saved_tensors
            counts = torch.bincount(idx.reshape(-1), minlength=V)[idx]
            return g / counts.unsqueeze(-1).to(g.dtype), None


    class DilutedUpstream(TinyGPT):
        def embed(self, idx):
            return Diluted.apply(self.wte(idx), idx)


    def make_model():
        return DilutedUpstream()
'''


def test_rows_of_repeated_tokens_that_each_sum_their_uses_exactly_are_not_named_duplicates(
        tmp_path: Path) -> None:
    """The forward check finds exactly the rows of repeated tokens wrong, the pattern of
    duplicates_not_accumulated; but every row is exactly the sum of the gradients its uses
    received (rows: 0 wrong), so the tie summed every occurrence and the pattern does not
    explain the rows: the label is gradient_disagrees_with_forward, with the reason (what
    transformers' HRM, which runs part of its forward under no_grad, was mislabelled)."""
    rep = check(tmp_path, "fp_diluted_upstream", DILUTED_UPSTREAM, only="one-token-repeated")
    assert_wrong(rep, "gradient_disagrees_with_forward")
    (result,) = rep.results
    assert result.diagnosis is not None
    assert result.diagnosis.rows_label == "correct", summary(rep)
    assert "duplicates_not_accumulated" in failed_checks(rep)["gradient against the forward"]
    assert "the tie summed every use" in result.diagnosis.detail, summary(rep)
