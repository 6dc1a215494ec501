"""The torch kind on correct models written the ways real code writes them (issue 17).

Every model here trains correctly: its tied gradient is the sum of both paths.  Each imitates
one convention of real code that a checker can get wrong (an embedding module that scales its
output, an in-place scale, several lookups of one Parameter, a head that is no module, a lambda
closing over its module, a bfloat16 body, keyword-only targets, a short context, ...), and
``tyingspec check --kind torch`` must exit 0 on it.  The last ones are not a correct tie at all:
an untied model and a target whose optimizer raises must exit 2, never 0.

Each model is the source of a small module (V 37-61, d 8-16, one block) written into
``tmp_path`` under a name of its own, checked in a worker process as a user's
``module:make_model`` is.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from torch_sources import check, shapes, summary

from tyingspec._src.front.check import CheckReport


def assert_correct(rep: CheckReport, *, low_precision: bool = False) -> None:
    """Exit 0, every case correct; at bfloat16 a case may lack the power to tell (one token
    repeated: its input path is within bfloat16's bounds), never all of them (exit 1)."""
    assert rep.load_error is None, summary(rep)
    assert rep.results, summary(rep)
    assert rep.exit_code == 0, summary(rep)
    labels = {r.diagnosis.label for r in rep.results if r.diagnosis}
    allowed = {"correct", "no_power"} if low_precision else {"correct"}
    assert "correct" in labels and labels <= allowed, summary(rep)


def ran_checks(rep: CheckReport) -> set[str]:
    """The checks that passed in every case."""
    sets = [{f.check for f in r.diagnosis.findings if f.outcome == "passed"}
            for r in rep.results if r.diagnosis]
    return set.intersection(*sets) if sets else set()


# --- 1, 2: scaled lookups ---------------------------------------------------------------------

GEMMA = '''
    class ScaledWordEmbedding(nn.Embedding):
        """Gemma's embedding module: its output is not W[ids] but W[ids] * sqrt(d)."""

        def __init__(self, num, dim, embed_scale=1.0):
            super().__init__(num, dim)
            self.embed_scale = embed_scale

        def forward(self, input_ids):
            return super().forward(input_ids) * self.embed_scale


    class Gemmaish(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = ScaledWordEmbedding(V, D, embed_scale=math.sqrt(D))
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.embed_tokens.weight
            small_init(self, std=0.1)

        def forward(self, input_ids):
            return self.lm_head(self.body(self.embed_tokens(input_ids)))


    def make_model():
        return Gemmaish()
'''

CTRL = '''
    class CTRLish(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Embedding(V, D)
            self.pos_embedding = nn.Embedding(T, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.w.weight
            small_init(self, std=0.1)

        def forward(self, idx):
            x = self.w(idx)
            x *= math.sqrt(D)  # CTRL scales the lookup's output in place
            x = x + self.pos_embedding(torch.arange(idx.shape[1]))
            return self.lm_head(self.body(x))


    def make_model():
        return CTRLish()
'''


def test_an_embedding_module_that_scales_its_output_is_correct(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_gemma_scaled", GEMMA)
    assert_correct(rep)
    assert "gradient against the forward" in ran_checks(rep), summary(rep)


def test_an_in_place_scale_of_the_lookup_is_correct(tmp_path: Path) -> None:
    assert_correct(check(tmp_path, "conv_ctrl_inplace", CTRL))


# --- 3: one Parameter, several lookup modules ------------------------------------------------

SHARED = '''
    from types import SimpleNamespace


    class Seq2Seqish(nn.Module):
        """Bart's layout: `shared`, `encoder_embed`, `decoder_embed` and `lm_head` are four names
        of one Parameter; the decoder reads the labels shifted right."""

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(pad_token_id=PAD_TOKEN_ID)
            pad = self.config.pad_token_id
            self.shared = nn.Embedding(V, D, padding_idx=pad)
            self.encoder_embed = nn.Embedding(V, D, padding_idx=pad)
            self.encoder_embed.weight = self.shared.weight
            self.decoder_embed = nn.Embedding(V, D, padding_idx=pad)
            self.decoder_embed.weight = self.shared.weight
            self.encoder = Body()
            self.decoder = Body()
            self.cross = nn.Linear(D, D)
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.shared.weight
            small_init(self)

        def forward(self, input_ids, labels=None):
            memory = self.encoder(self.encoder_embed(input_ids)).mean(1, keepdim=True)
            start = torch.zeros_like(labels[:, :1])
            decoder_input_ids = torch.cat([start, labels[:, :-1]], dim=1)
            h = self.decoder(self.decoder_embed(decoder_input_ids) + self.cross(memory))
            logits = self.lm_head(h)
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
            return loss, logits


    def make_model():
        return Seq2Seqish()
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("pad", [None, 1], ids=["no-padding", "bart-pad-token-1"])
def test_several_lookup_modules_sharing_the_parameter_are_correct(tmp_path: Path,
                                                                  pad: int | None) -> None:
    # Bart's three lookups all skip its config's pad_token_id = 1 in their backward; the head
    # still moves that row
    source = f"PAD_TOKEN_ID = {pad}\n" + textwrap.dedent(SHARED)
    rep = check(tmp_path, f"conv_shared_lookups_{pad}", source)
    assert_correct(rep)
    assert "gradient by path" not in {f.check for r in rep.results if r.diagnosis
                                      for f in r.diagnosis.findings
                                      if f.outcome == "not_applicable"}, summary(rep)


# --- 4: heads that are no module -------------------------------------------------------------

TIED_LINEAR = '''
    class TiedLinear:
        """torchtune's TiedLinear: a plain class holding the embedding module."""

        def __init__(self, tied_module):
            self.tied_module = tied_module

        def __call__(self, x):
            return F.linear(x, self.tied_module.weight)


    class Tunish(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(V, D)
            self.body = Body()
            self.output = TiedLinear(self.tok_embeddings)
            small_init(self)

        def forward(self, tokens):
            return self.output(self.body(self.tok_embeddings(tokens)))


    def make_model():
        return Tunish()
'''

FUNCTIONAL_HEAD = '''
    class FunctionalHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            small_init(self)

        def forward(self, idx):
            x = self.body(self.wte(idx))
            return x @ self.wte.weight.T


    def make_model():
        return FunctionalHead()
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module, source", [("conv_tied_linear", TIED_LINEAR),
                                            ("conv_functional_head", FUNCTIONAL_HEAD)],
                         ids=["torchtune-TiedLinear", "x-at-wte-weight-T"])
def test_a_head_that_holds_the_parameter_under_no_name_of_its_own_is_correct(
        tmp_path: Path, module: str, source: str) -> None:
    rep = check(tmp_path, module, source)
    assert_correct(rep)
    assert "tie discovered" in ran_checks(rep), summary(rep)


# --- 5: minGPT's lambda ----------------------------------------------------------------------

MINGPT = '''
    class Block(nn.Module):
        def __init__(self, d, resid_pdrop):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.mlp = nn.ModuleDict(dict(
                c_fc=nn.Linear(d, 4 * d), c_proj=nn.Linear(4 * d, d), act=nn.GELU(),
                dropout=nn.Dropout(resid_pdrop)))
            m = self.mlp
            self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))  # minGPT's MLP forward

        def forward(self, x):
            return x + self.mlpf(self.ln_1(x))


    class MinGPT(nn.Module):
        def __init__(self, embd_pdrop=0.1, resid_pdrop=0.1):
            super().__init__()
            self.block_size = T
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(V, D), wpe=nn.Embedding(T, D), drop=nn.Dropout(embd_pdrop),
                h=nn.ModuleList([Block(D, resid_pdrop)]), ln_f=nn.LayerNorm(D)))
            self.lm_head = nn.Linear(D, V, bias=False)
            self.transformer.wte.weight = self.lm_head.weight
            small_init(self)

        def forward(self, idx, targets=None):
            pos = torch.arange(idx.shape[1]).unsqueeze(0)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            loss = None
            if targets is not None:
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=-1)
            return logits, loss


    def make_model():
        return MinGPT()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_lambda_closing_over_its_module_with_dropout_configured_is_correct(
        tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_mingpt_lambda", MINGPT)
    assert_correct(rep)
    assert {"fresh gradient", "micro-batches accumulate"} <= ran_checks(rep), summary(rep)


# --- 6: low-precision bodies -----------------------------------------------------------------

CFG_BF16 = '''
    GPT_CONFIG = {"vocab_size": V, "emb_dim": D, "context_length": 12, "drop_rate": 0.1,
                  "dtype": torch.bfloat16}


    class FromScratch(nn.Module):
        """LLMs-from-scratch style: a plain config dict, every layer built in cfg["dtype"]."""

        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg
            dt = cfg["dtype"]
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=dt)
            self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"], dtype=dt)
            self.drop_emb = nn.Dropout(cfg["drop_rate"])
            self.body = Body(cfg["emb_dim"], dtype=dt)
            self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=dt)
            self.out_head.weight = self.tok_emb.weight
            small_init(self)

        def forward(self, in_idx):
            pos = self.pos_emb(torch.arange(in_idx.shape[1]))
            x = self.drop_emb(self.tok_emb(in_idx) + pos)
            return self.out_head(self.body(x))


    def make_model():
        return FromScratch(GPT_CONFIG)
'''

FLOAT_LOGITS = '''
    class Mambaish(nn.Module):
        """A bfloat16 body whose head returns float32 logits (Mamba-family `.float()`)."""

        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.embedding.weight
            small_init(self)

        def forward(self, input_ids):
            return self.lm_head(self.body(self.embedding(input_ids))).float()


    def make_model():
        return Mambaish().to(torch.bfloat16)
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module, source", [("conv_cfg_bf16", CFG_BF16),
                                            ("conv_float_logits", FLOAT_LOGITS)],
                         ids=["cfg-dtype-bfloat16", "float-logits-from-bfloat16"])
def test_a_bfloat16_model_is_correct_at_its_own_precision(tmp_path: Path, module: str,
                                                           source: str) -> None:
    rep = check(tmp_path, module, source)
    assert_correct(rep, low_precision=True)
    # judged at the precision it trains in, not at float64 bounds it could never meet
    assert {r.precision for r in rep.results} <= {"bfloat16", None}, summary(rep)


# --- 7: forward signatures -------------------------------------------------------------------

KEYWORD_TARGETS = '''
    class KeywordTargets(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx, *, targets=None):
            logits = self.lm_head(self.body(self.wte(idx)))
            if targets is None:
                return logits, None
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


    def make_model():
        return KeywordTargets()
'''

RETURN_EMBEDDINGS = '''
    class XTransformerish(nn.Module):
        """x-transformers: the second positional parameter is a flag, not the targets."""

        def __init__(self):
            super().__init__()
            self.token_emb = nn.Embedding(V, D)
            self.body = Body()
            small_init(self)

        def forward(self, x, return_embeddings=False, mask=None):
            h = self.body(self.token_emb(x))
            if return_embeddings:
                return h
            return F.linear(h, self.token_emb.weight)


    def make_model():
        return XTransformerish()
'''


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module, source", [("conv_kwonly_targets", KEYWORD_TARGETS),
                                            ("conv_return_embeddings", RETURN_EMBEDDINGS)],
                         ids=["keyword-only-targets", "return-embeddings-flag"])
def test_forward_signatures_are_called_as_their_authors_meant(tmp_path: Path, module: str,
                                                              source: str) -> None:
    assert_correct(check(tmp_path, module, source))


# --- 8: the batch's sequence length ---------------------------------------------------------

CONTEXT_IN_CFG = '''
    class CfgContext(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = {"vocab_size": V, "emb_dim": D}
            self.cfg["context_length"] = 12
            self.tok_emb = nn.Embedding(V, D)
            self.pos_emb = nn.Embedding(self.cfg["context_length"], D)
            self.body = Body()
            self.out_head = nn.Linear(D, V, bias=False)
            self.out_head.weight = self.tok_emb.weight
            small_init(self)

        def forward(self, idx):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
            return self.out_head(self.body(x))


    def make_model():
        return CfgContext()
'''

SHORT_TABLE = '''
    class ShortTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.{name} = nn.Embedding(8, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx):
            x = self.wte(idx) + self.{name}(torch.arange(idx.shape[1]))
            return self.lm_head(self.body(x))


    def make_model():
        return ShortTable()
'''


def test_a_context_length_in_a_config_dict_sets_the_sequence_length(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_cfg_context", CONTEXT_IN_CFG)
    assert_correct(rep)
    # its whole context, and no more
    assert max(T for _, T in shapes(rep)) == 12, summary(rep)
    assert any("context 12 positions" in n for n in rep.notes), rep.notes


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name", ["pos_embedding", "wpe"])
def test_a_position_table_shorter_than_16_sets_the_sequence_length(tmp_path: Path,
                                                                   name: str) -> None:
    rep = check(tmp_path, f"conv_short_table_{name}", SHORT_TABLE.replace("{name}", name))
    assert_correct(rep)
    assert max(T for _, T in shapes(rep)) == 8, summary(rep)


# --- 9: scale_grad_by_freq -------------------------------------------------------------------

SCALE_GRAD_BY_FREQ = '''
    class FreqScaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D, scale_grad_by_freq=True)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx):
            return self.lm_head(self.body(self.wte(idx)))


    def make_model():
        return FreqScaled()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_scale_grad_by_freq_is_torchs_declared_semantics(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_scale_grad_by_freq", SCALE_GRAD_BY_FREQ)
    assert_correct(rep)
    # the reference is built from the observed uses, under the lookup's own option
    assert "gradient by path" not in {f.check for r in rep.results if r.diagnosis
                                      for f in r.diagnosis.findings
                                      if f.outcome == "not_applicable"}, summary(rep)


# --- 10: a deferred weight gradient finished after backward ---------------------------------

DEFERRED = '''
    class DeferredWgrad(torch.autograd.Function):
        """TransformerEngine-style delayed wgrad: the backward returns dgrad only and queues
        g.T @ h on the layer; the training loop calls backward_dw() after loss.backward()."""

        @staticmethod
        def forward(ctx, h, weight, layer):
            ctx.save_for_backward(h, weight)
            ctx.layer = layer
            return h @ weight.T

        @staticmethod
        def backward(ctx, g):
            h, weight = ctx.saved_tensors
            ctx.layer.pending.append(g.flatten(0, -2).T @ h.flatten(0, -2))
            return g @ weight, None, None


    class DeferredLinear(nn.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pending = []

        def forward(self, x):
            return DeferredWgrad.apply(x, self.weight, self)

        def backward_dw(self):
            for wgrad in self.pending:
                if self.weight.grad is None:
                    self.weight.grad = wgrad.clone()
                else:
                    self.weight.grad += wgrad
            self.pending.clear()


    class Deferred(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = DeferredLinear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx):
            return self.lm_head(self.body(self.wte(idx)))


    def finish(model):
        for module in model.modules():
            if hasattr(module, "backward_dw"):
                module.backward_dw()


    make_model = TorchTarget(model=Deferred, after_backward=finish)
    unfinished = TorchTarget(model=Deferred)
'''


#: The finish step, as a training loop writes it: walking every module, or naming the layer.
FINISH_BODY = """        for module in model.modules():
            if hasattr(module, "backward_dw"):
                module.backward_dw()"""
assert FINISH_BODY in DEFERRED
FINISH_BY_ATTRIBUTE = """        model.lm_head.backward_dw()"""


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("finish", ["every-module", "by-attribute"])
def test_after_backward_finishes_a_deferred_weight_gradient(tmp_path: Path, finish: str) -> None:
    # after_backward is handed the user's model: a finish step that names its layer
    # (`model.lm_head`) must work as well as one that walks `model.modules()`
    source = DEFERRED if finish == "every-module" else \
        DEFERRED.replace(FINISH_BODY, FINISH_BY_ATTRIBUTE)
    assert_correct(check(tmp_path, f"conv_deferred_{finish.replace('-', '_')}", source))


@pytest.mark.slow
@pytest.mark.moved
def test_without_after_backward_the_deferred_head_gradient_is_missing(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_deferred_unfinished", DEFERRED, attr="unfinished")
    assert rep.load_error is None, summary(rep)
    assert rep.exit_code == 1, summary(rep)
    assert rep.diagnosis_label not in ("correct", "adapter_error", "no_power"), summary(rep)
    # the head's contribution never reached .grad: every row is wrong, absent ones too, so
    # no case may be blamed on the input path or on repeated tokens
    blamed = {r.diagnosis.label for r in rep.results if r.diagnosis and r.status == "wrong"}
    assert not blamed & {"duplicates_not_accumulated", "input_path_missing",
                         "input_path_wrong"}, summary(rep)


# --- 11: no tie at all -----------------------------------------------------------------------

UNTIED_PLAIN = '''
    class Untied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            small_init(self)

        def forward(self, idx):
            return self.lm_head(self.body(self.wte(idx)))


    def make_model():
        return Untied()
'''

UNTIED_LLAMA = '''
    from transformers import LlamaConfig, LlamaForCausalLM


    def make_model():
        config = LlamaConfig(vocab_size=53, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=32, tie_word_embeddings=False)
        return LlamaForCausalLM(config)
'''


def test_a_plain_untied_model_is_a_usage_error(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_untied_plain", UNTIED_PLAIN)
    assert rep.exit_code == 2, summary(rep)
    assert rep.load_error is not None and "found no tie" in rep.load_error, summary(rep)


@pytest.mark.slow
def test_an_untied_llama_says_its_config_unties_it(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_untied_llama", UNTIED_LLAMA)
    assert rep.exit_code == 2, summary(rep)
    assert rep.load_error is not None, summary(rep)
    assert "found no tie" in rep.load_error, rep.load_error
    assert "config.tie_word_embeddings=False" in rep.load_error, rep.load_error


# --- 12: an optimizer that raises ------------------------------------------------------------

RAISING_OPTIMIZER = '''
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx):
            return self.lm_head(self.body(self.wte(idx)))


    make_model = TorchTarget(model=Plain,
                             optimizer=lambda m: (_ for _ in ()).throw(RuntimeError("boom")))
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_target_optimizer_that_raises_is_an_adapter_error(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_raising_optimizer", RAISING_OPTIMIZER)
    assert rep.exit_code == 2, summary(rep)
    errors = [rep.load_error or ""] + [r.error or "" for r in rep.results]
    assert any("boom" in e for e in errors), summary(rep)


# --- 13: a custom autograd.Function lookup ---------------------------------------------------

FUNCTION_LOOKUP = '''
    class Lookup(torch.autograd.Function):
        """A hand-written embedding lookup whose backward is right: index_add accumulates every
        occurrence of a repeated token."""

        @staticmethod
        def forward(ctx, weight, ids):
            ctx.save_for_backward(ids)
            ctx.shape = weight.shape
            return weight[ids]

        @staticmethod
        def backward(ctx, dy):
            (ids,) = ctx.saved_tensors
            grad = dy.new_zeros(ctx.shape)
            grad.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
            return grad, None


    class FunctionEmbedding(nn.Embedding):
        def forward(self, ids):
            return Lookup.apply(self.weight, ids)


    class CustomLookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = FunctionEmbedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def forward(self, idx):
            return self.lm_head(self.body(self.wte(idx)))


    def make_model():
        return CustomLookup()
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_custom_function_lookup_with_a_correct_backward_is_correct(tmp_path: Path) -> None:
    rep = check(tmp_path, "conv_function_lookup", FUNCTION_LOOKUP)
    assert_correct(rep)
    # its uses cannot be observed: the forward check is what decides, and it ran
    assert "gradient against the forward" in ran_checks(rep), summary(rep)


# --- a lookup whose output is detached: the step's finding names the input path ------------

DETACHED_LOOKUP = '''
    class DetachedLookup(nn.Module):
        """The embedding module is seen by the observer, but its output is detached: no lookup
        gradient reaches the tied weight (the input path is dropped)."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx, targets):
            logits = self.head(self.body(self.wte(idx).detach()))
            return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


    def make_model():
        torch.manual_seed(0)
        return small_init(DetachedLookup())
'''


@pytest.mark.slow
@pytest.mark.moved
def test_a_detached_lookup_is_named_input_path_missing_after_training_steps_too(
        tmp_path: Path) -> None:
    # On a batch of repeated tokens every present row is a repeated token's row, so "exactly
    # rows of tokens seen more than once" fits the wrong rows as well as "present rows": only
    # the evidence that no lookup gradient reaches E tells them apart.  The step's own pass
    # sees the lookup receive no gradient; it once labelled the step duplicates_not_accumulated.
    rep = check(tmp_path, "detached_lookup", DETACHED_LOOKUP, only="repeated-tokens")
    assert rep.exit_code == 1, summary(rep)
    (result,) = rep.results
    assert result.diagnosis is not None, summary(rep)
    steps = [f for f in result.diagnosis.findings if f.check == "gradient at every training step"]
    assert [f.outcome for f in steps] == ["failed"], summary(rep)
    assert steps[0].label == "input_path_missing", summary(rep)
    assert "never reaches E through autograd" in steps[0].detail, summary(rep)
    assert result.diagnosis.label == "input_path_missing", summary(rep)
