"""The torch kind on the configuration a user trains with (issue 49 §2).

Each wrong model below is right in the one small setting the check used to run (at most 128
positions, 2 x 128 tokens, three steps, no padding, no mask, no dropout, one loss path, no
autocast or compile) and wrong just past it: a hand-written backward that disagrees with its
own forward there, a detached read, a mis-normalised loss.  Each must make
``tyingspec check --kind torch`` exit 1 with the label that names it: through the defaults,
which now cover the model's whole context, batches of a thousand tokens, padding with -100
targets and an attention mask, every loss path the model has, its configured dropout,
several micro-batches and steps drawn past three; or through the flags and the
``TorchTarget(step=...)`` that run the user's own configuration.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch_sources
from torch_sources import shapes, summary

from tyingspec._src.front.check import CheckReport

#: A tiny GPT whose lookup and head a subclass replaces; its context, dropout and forward's
#: extra arguments are set per model.
PRELUDE = torch_sources.PRELUDE + textwrap.dedent('''
    class Plain(torch.autograd.Function):
        """E[ids] with a hand-written backward: index_add_ (repeats add), or index_put_
        without accumulate (the last copy of a repeated token wins) where ``add`` is False."""

        @staticmethod
        def forward(ctx, weight, ids, add=True):
            ctx.save_for_backward(ids)
            ctx.shape, ctx.add = weight.shape, add
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            flat, rows = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
            grad = dy.new_zeros(ctx.shape)
            if ctx.add:
                grad.index_add_(0, flat, rows)
            else:
                grad[flat] = rows
            return grad, None, None


    class TinyGPT(nn.Module):
        def __init__(self, block_size=T, p=0.0):
            super().__init__()
            self.block_size = block_size
            self.embd_pdrop = p
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


def check(tmp_path: Path, module: str, source: str, *, only: str | None = None,
          **flags: str) -> CheckReport:
    """:func:`torch_sources.check` with this file's models."""
    return torch_sources.check(tmp_path, module, source, prelude=PRELUDE, only=only, **flags)


def assert_wrong(rep: CheckReport, *labels: str) -> None:
    assert rep.load_error is None, summary(rep)
    assert rep.exit_code == 1, summary(rep)
    assert rep.diagnosis_label in labels, summary(rep)


def assert_correct(rep: CheckReport) -> None:
    assert rep.load_error is None, summary(rep)
    assert rep.exit_code == 0, summary(rep)


# --- sizes: the whole context, a thousand tokens ---------------------------------------------

FIRST_128 = '''
    class FirstPositions(torch.autograd.Function):
        """The lookup's backward covers the first 128 positions of each sequence only (a
        kernel tuned for a context of 128, in a model of 512)."""

        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape = weight.shape
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            grad = dy.new_zeros(ctx.shape)
            grad.index_add_(0, ids[:, :128].reshape(-1), dy[:, :128].reshape(-1, dy.shape[-1]))
            return grad, None


    class Model(TinyGPT):
        def embed(self, idx):
            return FirstPositions.apply(self.wte.weight, idx)


    def make_model():
        return Model(block_size=512)
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_lookup_right_for_the_first_128_positions_of_a_512_context(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_first_128", FIRST_128, only="repeated-tokens")
    assert_wrong(rep, "input_path_wrong")
    assert max(T for _, T in shapes(rep)) == 512, summary(rep)


PAST_256 = '''
    class Model(TinyGPT):
        """Repeated tokens stop adding once a batch holds more than 256 tokens (a kernel that
        switches to an unsafe scatter for large batches)."""

        def embed(self, idx):
            return Plain.apply(self.wte.weight, idx, idx.numel() <= 256)


    def make_model():
        return Model(block_size=128)
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_lookup_that_drops_repeats_past_256_tokens_a_batch(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_past_256", PAST_256, only="repeated-tokens")
    assert_wrong(rep, "duplicates_not_accumulated")
    assert max(B * T for B, T in shapes(rep)) >= 1024, summary(rep)


AFTER_FIVE = '''
    class Model(TinyGPT):
        """A warm-up switch: from the sixth training forward on, the lookup reads a detached
        table (its input path is gone)."""

        def __init__(self):
            super().__init__()
            self.forwards = 0

        def embed(self, idx):
            if self.training:
                self.forwards += 1
            if self.forwards > 5:
                return F.embedding(idx, self.wte.weight.detach())
            return self.wte(idx)


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_bug_that_starts_after_the_fifth_forward(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_after_five", AFTER_FIVE, only="absent-tokens")
    assert_wrong(rep, "input_path_missing")


# --- padding, ignored targets, the attention mask, the loss paths ----------------------------

COUNTS_PADDING = '''
    class Model(TinyGPT):
        """Its loss sums over the targets it keeps and divides by every position, the ignored
        (-100) ones included."""

        def forward(self, idx, targets=None):
            logits = super().forward(idx)
            if targets is None:
                return logits
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
                                   ignore_index=-100, reduction="sum") / targets.numel()
            return logits, loss


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_loss_that_counts_the_ignored_positions_in_its_mean(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_counts_padding", COUNTS_PADDING)
    assert_wrong(rep, "ignored_counted_in_mean")


MASK_PATH = '''
    class Model(TinyGPT):
        """With an attention mask it takes another lookup, a detached one."""

        def forward(self, idx, attention_mask=None):
            if attention_mask is None:
                x = self.wte(idx)
            else:
                x = F.embedding(idx, self.wte.weight.detach()) * attention_mask[..., None]
            x = x + self.pos_emb(torch.arange(idx.shape[1]))
            return self.head(self.body(x))


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_path_taken_only_when_an_attention_mask_is_passed(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_mask_path", MASK_PATH)
    assert_wrong(rep, "input_path_missing")


DROPOUT = '''
    class FusedDropoutLookup(torch.autograd.Function):
        """E[ids] with embedding dropout fused in; the backward forgets the 1 / (1 - p)."""

        @staticmethod
        def forward(ctx, weight, ids, p):
            keep = (torch.rand(ids.shape + (weight.shape[1],)) >= p).to(weight.dtype)
            ctx.save_for_backward(ids, keep)
            ctx.shape = weight.shape
            return weight[ids] * keep / (1 - p)

        @staticmethod
        def backward(ctx, dy):
            ids, keep = ctx.saved_tensors
            grad = dy.new_zeros(ctx.shape)
            grad.index_add_(0, ids.reshape(-1), (dy * keep).reshape(-1, dy.shape[-1]))
            return grad, None, None


    class Model(TinyGPT):
        def embed(self, idx):
            if self.training and self.embd_pdrop > 0:
                return FusedDropoutLookup.apply(self.wte.weight, idx, self.embd_pdrop)
            return self.wte(idx)


    def make_model():
        return Model(p=0.25)
'''


@pytest.mark.slow
@pytest.mark.moved
def test_fused_embedding_dropout_that_forgets_its_scale(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_dropout", DROPOUT, only="absent-tokens")
    assert_wrong(rep, "input_path_wrong", "path_scaled")


LABELS_PATH = '''
    class Model(TinyGPT):
        """transformers-style: labels= computes the loss the Trainer trains, through a head
        that detaches the tied weight; without labels it returns logits (the explicit-loss
        path a hand-written loop takes), which are right."""

        def forward(self, input_ids, labels=None):
            x = self.embed(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1]))
            h = self.body(x)
            if labels is None:
                return self.head(h)
            logits = h @ self.wte.weight.detach().T
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_labels_path_that_differs_from_the_explicit_loss_path(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_labels_path", LABELS_PATH)
    assert_wrong(rep, "output_path_missing", "output_path_wrong")
    paths = {f.detail for r in rep.results for f in r.diagnosis.findings
             if f.check == "configuration"}
    assert any("labels=" in p for p in paths) and any("logits" in p for p in paths), paths


# --- autocast and compile -------------------------------------------------------------------

AUTOCAST_HEAD = '''
    class Head(torch.autograd.Function):
        """h @ W.T whose weight gradient is halved when it ran under autocast."""

        @staticmethod
        def forward(ctx, h, weight):
            ctx.save_for_backward(h, weight)
            ctx.autocast = torch.is_autocast_enabled("cpu")
            return h @ weight.T.to(h.dtype)

        @staticmethod
        def backward(ctx, g):
            h, weight = ctx.saved_tensors
            grad_w = (g.flatten(0, -2).T.float() @ h.flatten(0, -2).float()).to(weight.dtype)
            grad_h = (g.float() @ weight.float()).to(h.dtype)
            return grad_h, grad_w * (0.5 if ctx.autocast else 1.0)


    class Model(TinyGPT):
        def head(self, h):
            return Head.apply(h, self.lm_head.weight)


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_head_halved_only_under_autocast(tmp_path: Path) -> None:
    plain = check(tmp_path, "cfg_autocast_head", AUTOCAST_HEAD, only="absent-tokens")
    assert_correct(plain)  # right without autocast: the bug is in that path alone
    rep = check(tmp_path, "cfg_autocast_head", AUTOCAST_HEAD, only="absent-tokens",
                autocast="bfloat16")
    assert_wrong(rep, "path_scaled", "output_path_wrong")
    assert rep.results[0].precision == "bfloat16", summary(rep)


COMPILE_REPEATS = '''
    class Model(TinyGPT):
        """Repeated tokens stop adding while torch.compile traces the lookup."""

        def embed(self, idx):
            return Plain.apply(self.wte.weight, idx, not torch.compiler.is_compiling())


    def make_model():
        return Model()
'''


@pytest.mark.slow
def test_a_lookup_that_loses_repeats_only_under_compile(tmp_path: Path) -> None:
    plain = check(tmp_path, "cfg_compile_repeats", COMPILE_REPEATS, only="repeated-tokens")
    assert_correct(plain)
    rep = check(tmp_path, "cfg_compile_repeats", COMPILE_REPEATS, only="repeated-tokens",
                compile="aot_eager")
    assert_wrong(rep, "duplicates_not_accumulated")


# --- the user's own step ----------------------------------------------------------------------

STEP = '''
    def optimizer(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3)


    def step(model, optimizer, batch):
        """Three micro-batches under bfloat16 autocast, clipping, AdamW."""
        {zero_first}
        parts = batch.micro_batches(3)
        for part in parts:
            {zero_each}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(part.input_ids)
                loss = F.cross_entropy(logits.float().reshape(-1, V), part.labels.reshape(-1),
                                       ignore_index=-100)
            (loss / len(parts)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()


    make_model = TorchTarget(model=TinyGPT, optimizer={optimizer}, step=step)
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("zero_first, zero_each, optimizer, code, label", [
    ("optimizer.zero_grad()", "", "optimizer", 0, "correct"),
    ("", "", "optimizer", 1, "gradient_not_zeroed"),
    ("", "optimizer.zero_grad()", "optimizer", 1, "gradient_assigned"),
    ("optimizer.zero_grad()", "",
     "lambda m: torch.optim.SGD([m.wte.weight, *m.parameters()], lr=0.1)", 1,
     "optimizer_sees_tie_twice"),
], ids=["correct", "never-zeroed", "zeroed-per-micro-batch", "tie-listed-twice"])
def test_the_users_own_step_is_judged_at_every_step(tmp_path: Path, zero_first: str,
                                                    zero_each: str, optimizer: str, code: int,
                                                    label: str) -> None:
    source = STEP.format(zero_first=zero_first or "pass", zero_each=zero_each or "pass",
                         optimizer=optimizer)
    rep = check(tmp_path, f"cfg_step_{code}_{len(zero_each)}_{len(optimizer)}", source,
                only="repeated-tokens")
    assert rep.exit_code == code, summary(rep)
    assert rep.diagnosis_label == label, summary(rep)
    steps = [f for r in rep.results for f in r.diagnosis.findings
             if f.check == "gradient at every training step"]
    assert steps and "your step" in steps[0].invariant, summary(rep)
    if code == 0:
        assert "rescaled by" in steps[0].detail, steps[0].detail  # the clipping, divided out


# --- correct models the check called wrong or refused (issue 49 §3) -------------------------

PADDING_ROW = '''
    class Model(TinyGPT):
        """A from-scratch model that declares padding_idx=0 and has no config: token 0 is its
        pad token, never a real one."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D, padding_idx=0)
            self.lm_head.weight = self.wte.weight
            small_init(self)


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_padding_row_nothing_names_real_is_never_drawn_as_a_real_token(tmp_path: Path
                                                                          ) -> None:
    rep = check(tmp_path, "cfg_padding_row", PADDING_ROW)
    assert_correct(rep)
    pad_cases = [r for r in rep.results if "pad=1" in r.case.setting]
    assert pad_cases, summary(rep)  # token 0 still pads, where a case pads


KEYWORDS = '''
    class Model(TinyGPT):
        """forward(input_ids, targets, labels), all required: handed what it takes."""

        def forward(self, input_ids, targets, labels):
            logits = super().forward(input_ids)
            return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_forward_with_required_targets_and_labels_is_handed_both(tmp_path: Path) -> None:
    assert_correct(check(tmp_path, "cfg_keywords", KEYWORDS))


LOSS_READS_MODEL = '''
    def loss(m, tokens, targets):
        """A loss that reads the model's own attributes, as a runtime's gradient hook does."""
        logits = m.lm_head(m.body(m.wte(tokens) + m.pos_emb(torch.arange(tokens.shape[1]))))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


    class Detached(TinyGPT):
        def embed(self, idx):
            return F.embedding(idx, self.wte.weight.detach())


    make_model = TorchTarget(model={model}, loss=loss)
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("model, code", [("TinyGPT", 0), ("Detached", 0)])
def test_a_loss_that_reads_the_models_attributes_gets_the_users_model(tmp_path: Path,
                                                                     model: str,
                                                                     code: int) -> None:
    # the loss itself reads m.wte directly, so the detached subclass's embed is never called:
    # both are correct; what used to fail is "'_Untied' object has no attribute 'wte'"
    rep = check(tmp_path, f"cfg_loss_reads_{model}", LOSS_READS_MODEL.format(model=model))
    assert rep.exit_code == code, summary(rep)


SHORT_POSITIONS = '''
    class Model(TinyGPT):
        """Declares a context of 64 (its config dict) but its position table holds 24 and is
        called something no convention names."""

        def __init__(self):
            super().__init__(block_size=64)
            self.cfg = {"context_length": 64}
            del self.pos_emb
            self.table = nn.Embedding(24, D)


        def forward(self, idx):
            x = self.embed(idx) + self.table(torch.arange(idx.shape[1]))
            return self.head(self.body(x))


    def make_model():
        return Model()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_position_table_shorter_than_the_declared_context_is_fitted(tmp_path: Path) -> None:
    rep = check(tmp_path, "cfg_short_positions", SHORT_POSITIONS)
    assert_correct(rep)
    assert max(T for _, T in shapes(rep)) <= 24, summary(rep)
    assert any("TorchTarget(seq_len=" in n and "--shape" in n for n in rep.notes), rep.notes


CHUNKED_ASSIGN = '''
    class Chunked(torch.autograd.Function):
        """The lookup's backward in chunks of 64 tokens, each written with `=` where it must
        add: only the last chunk's rows survive (one chunk: right)."""

        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape = weight.shape
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            flat, rows = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
            grad = dy.new_zeros(ctx.shape)
            for start in range(0, flat.numel(), 64):
                part = dy.new_zeros(ctx.shape)
                part.index_add_(0, flat[start:start + 64], rows[start:start + 64])
                grad = part  # the bug: `=` for `+=`
            return grad, None


    class Model(TinyGPT):
        def embed(self, idx):
            return Chunked.apply(self.wte.weight, idx)


    def make_model():
        return Model(block_size=32)
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_chunked_lookup_backward_that_assigns_each_chunk(tmp_path: Path) -> None:
    # issue 50 section 7: at the old 2 x 32 tokens the batch was one chunk, and it passed
    rep = check(tmp_path, "cfg_chunked_assign", CHUNKED_ASSIGN, only="absent-tokens")
    assert_wrong(rep, "input_path_wrong", "input_path_missing")
    assert max(B * T for B, T in shapes(rep)) > 64, summary(rep)
