"""The torch kind on correct models it used to call wrong or refuse (issue 49 §3), and the
broken twin of each, so that what the support accepts does not hide a bug.

* ``nn.Embedding(max_norm=...)``: the forward rescales the rows it reads in place, under
  no_grad, and the gradient is a plain lookup's of the rescaled table.
* A tied table under ``torch.nn.utils.parametrize`` (a custom parametrization,
  ``torch.nn.utils.parametrizations.weight_norm``) or the older ``torch.nn.utils.weight_norm``:
  the uses read the computed weight ``W``, and the tie is judged at ``dL/dW``.
* A tie lost by a resize that left the two uses with different vocabularies: ``tie_lost``,
  not an error from the model's own forward.
* LED and Longformer from transformers' own tester configurations, at a length their
  attention pads (their float64 backward is NaN there; they train in float32).

Each model is the source of a small module written into ``tmp_path`` and checked in a worker
process as a user's ``module:make_model`` is (see ``tests/torch_sources.py``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch_sources
from torch_sources import summary

from tyingspec._src.front.check import CheckReport

PRELUDE = torch_sources.PRELUDE + textwrap.dedent('''
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm


    class TiedLM(nn.Module):
        """nanoGPT's tie by assignment; `embed` and `head` are the two uses a subclass
        changes, `parametrized` the modules a parametrization is then registered on."""

        def __init__(self, max_norm=None, std=0.3, parametrized=()):
            super().__init__()
            self.wte = nn.Embedding(V, D, max_norm=max_norm)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self, std)
            for name in parametrized:
                parametrize.register_parametrization(getattr(self, name), "weight", RowScale())

        def embed(self, idx):
            return self.wte(idx)

        def head(self, h):
            return self.lm_head(h)

        def forward(self, idx, targets):
            logits = self.head(self.body(self.embed(idx)))
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


    class MaxNormLM(TiedLM):
        """The tie on a lookup that renormalises the rows it reads."""

        def __init__(self, max_norm=1.0):
            super().__init__(max_norm=max_norm, std=0.5)


    class DetachedHead:
        """Mixed into a tied model: the head scores with a detached weight (no output path)."""

        def head(self, h):
            return F.linear(h, self.lm_head.weight.detach())


    class FunctionalHeadLM(nn.Module):
        """The head scores with the lookup module's own weight (nanoGPT's functional form,
        torchtune's TiedLinear): parametrize that weight and both uses read the computed W."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            small_init(self)

        def forward(self, idx, targets):
            x = self.wte(idx)
            # read after the lookup: the older weight_norm computes W in the lookup's
            # pre-hook, so a read before it would score with the previous pass's W
            logits = F.linear(self.body(x), self.wte.weight)
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


    class RowScale(nn.Module):
        """A custom parametrization: each row scaled by a function of itself."""

        def forward(self, X):
            return X * (1.0 + 0.1 * torch.tanh(X.sum(1, keepdim=True)))


    class LastOnly(torch.autograd.Function):
        """A lookup whose backward keeps one occurrence of each repeated token."""

        @staticmethod
        def forward(ctx, ids, W):
            ctx.save_for_backward(ids)
            ctx.shape = W.shape
            return W[ids]

        @staticmethod
        def backward(ctx, g):
            (ids,) = ctx.saved_tensors
            dW = torch.zeros(ctx.shape, dtype=g.dtype)
            dW.index_copy_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
            return None, dW
''')


def check(tmp_path: Path, module: str, source: str, attr: str = "make_model",
          only: str | None = None) -> CheckReport:
    return torch_sources.check(tmp_path, module, source, attr, prelude=PRELUDE, only=only)


def assert_correct(rep: CheckReport) -> None:
    assert rep.load_error is None, summary(rep)
    assert (rep.exit_code, rep.diagnosis_label) == (0, "correct"), summary(rep)


def assert_wrong(rep: CheckReport, *labels: str) -> None:
    assert rep.load_error is None, summary(rep)
    assert rep.exit_code == 1 and rep.diagnosis_label in labels, summary(rep)


def details(rep: CheckReport, check: str) -> list[str]:
    """The detail of every finding named ``check``, over every case."""
    return [f.detail for r in rep.results for f in (r.diagnosis.findings if r.diagnosis else ())
            if f.check == check]


# --- nn.Embedding(max_norm=...) ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("max_norm", [1.0, 1.7], ids=["every-row-renormalised",
                                                      "rows-on-both-sides-of-max-norm"])
def test_a_tied_max_norm_lookup_is_correct(tmp_path: Path, max_norm: float) -> None:
    # was exit 1: the optimizer check measured the step from the values before the forward
    # renormalised them, and the forward check differenced through the renormalisation
    rep = check(tmp_path, f"cm_max_norm_{int(max_norm * 10)}", f'''
        def make_model():
            return MaxNormLM(max_norm={max_norm})
    ''')
    assert_correct(rep)
    assert all("max_norm" in d for d in details(rep, "micro-batches accumulate")), summary(rep)


def test_a_max_norm_lookup_that_drops_repeats_is_still_caught(tmp_path: Path) -> None:
    rep = check(tmp_path, "cm_max_norm_last_only", '''
        class Broken(MaxNormLM):
            def embed(self, idx):
                with torch.no_grad():  # what F.embedding(max_norm=...) does first
                    torch.embedding_renorm_(self.wte.weight, idx, self.wte.max_norm, 2.0)
                return LastOnly.apply(idx, self.wte.weight)


        def make_model():
            return Broken()
    ''', only="one-token-repeated")
    assert_wrong(rep, "duplicates_not_accumulated")


@pytest.mark.slow  # the forward check spends its whole budget on the wrong rows
@pytest.mark.parametrize("base, arguments", [("MaxNormLM", ""),
                                             ("TiedLM", 'parametrized=("wte", "lm_head")')],
                         ids=["max-norm", "parametrized"])
def test_a_tie_whose_head_is_detached_is_still_caught(tmp_path: Path, base: str,
                                                      arguments: str) -> None:
    rep = check(tmp_path, f"cm_detached_head_{base.lower()}", f'''
        class Broken(DetachedHead, {base}):
            pass


        def make_model():
            return Broken({arguments})
    ''', only="one-token-repeated")
    # the plain model (no max_norm, no parametrization) with this bug gets the same verdict
    assert_wrong(rep, "output_path_missing", "gradient_disagrees_with_forward")


# --- a parametrized tied table -------------------------------------------------------------------

PARAMETRIZED = {
    "custom": '''
        def make_model():
            m = FunctionalHeadLM()
            parametrize.register_parametrization(m.wte, "weight", RowScale())
            return m
    ''',
    "weight-norm": '''
        def make_model():
            m = FunctionalHeadLM()
            weight_norm(m.wte)
            return m
    ''',
    "old-weight-norm": '''
        import warnings


        def make_model():
            m = FunctionalHeadLM()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated, still shipped
                torch.nn.utils.weight_norm(m.wte)
            return m
    ''',
    # tied by assignment, then both modules parametrized over the one Parameter
    "both-modules": '''
        def make_model():
            return TiedLM(parametrized=("wte", "lm_head"))
    ''',
    "named-by-the-target": '''
        def build():
            m = FunctionalHeadLM()
            weight_norm(m.wte)
            return m


        make_model = TorchTarget(model=build, embedding="wte.weight", head="wte.weight")
    ''',
}


#: the default tier runs these; the rest (one check each, a few seconds) are slow
FAST_PARAMETRIZED = ("custom", "weight-norm", "both-modules")


@pytest.mark.parametrize("how", [pytest.param(h, marks=() if h in FAST_PARAMETRIZED else
                                              pytest.mark.slow) for h in PARAMETRIZED])
def test_a_parametrized_tied_table_is_correct(tmp_path: Path, how: str) -> None:
    # was exit 2: "`weight` is not an nn.Parameter", from tyingspec's own lookup
    rep = check(tmp_path, f"cm_parametrized_{how.replace('-', '_')}", PARAMETRIZED[how],
                only="one-token-repeated")
    assert_correct(rep)
    found = details(rep, "tie discovered")
    assert found and all("judged at the parametrized weight" in d and
                         "before the parametrization's own backward" in d for d in found)
    # the optimizer holds the parametrization's Parameter(s), and moves each by one update
    assert all("exactly one update" in d for d in details(rep, "optimizer SGD")), summary(rep)


@pytest.mark.slow
@pytest.mark.moved
def test_a_parametrized_table_whose_lookup_drops_repeats_is_still_caught(tmp_path: Path) -> None:
    rep = check(tmp_path, "cm_parametrized_last_only", '''
        class Broken(FunctionalHeadLM):
            def forward(self, idx, targets):
                W = self.wte.weight  # one read: both uses consume this W
                logits = F.linear(self.body(LastOnly.apply(idx, W)), W)
                return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


        def make_model():
            m = Broken()
            weight_norm(m.wte)
            return m
    ''', only="one-token-repeated")
    assert_wrong(rep, "duplicates_not_accumulated")


@pytest.mark.parametrize("weight_norm", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["custom", "weight-norm"])
def test_a_table_parametrized_after_the_tie_was_made_is_a_lost_tie(
        tmp_path: Path, weight_norm: bool) -> None:
    # the lookup reads the parametrized weight, the head the Parameter it was tied to (weight
    # norm's v starts as a copy of it)
    rep = check(tmp_path, f"cm_parametrized_after_tie_{'wn' if weight_norm else 'custom'}",
                f'''
        def make_model():
            m = TiedLM()
            if {weight_norm}:
                weight_norm(m.wte)
            else:
                parametrize.register_parametrization(m.wte, "weight", RowScale())
            return m
    ''', only="one-token-repeated")
    assert_wrong(rep, "tie_lost")


# --- a tie lost by a resize ----------------------------------------------------------------------

RESIZE = '''
    from transformers import GPT2Config, GPT2LMHeadModel


    def gpt2():
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=1,
                                          n_head=2, bos_token_id=0, eos_token_id=0))


    def resized_embedding(m, rows):
        """A resize that replaces the input embedding and forgets the head."""
        old = m.get_input_embeddings()
        new = nn.Embedding(rows, old.weight.shape[1])
        with torch.no_grad():
            new.weight[:old.weight.shape[0]] = old.weight
        m.set_input_embeddings(new)
        return m
'''

RESIZED = {
    # the head keeps the old vocabulary and the config names the new one: transformers' loss
    # reshapes the logits by config.vocab_size, so the model's own forward fails on any batch
    "head-keeps-old-vocabulary": '''
        def make_model():
            m = resized_embedding(gpt2(), V + 8)
            m.config.vocab_size = V + 8
            return m
    ''',
    # the same, the config left as it was: a batch drawn for the embedding's vocabulary has
    # targets the head cannot score
    "config-not-updated": '''
        def make_model():
            return resized_embedding(gpt2(), V + 8)
    ''',
    # the resize gave the head the new vocabulary and left the embedding
    "head-replaced": '''
        def make_model():
            m = gpt2()
            m.set_output_embeddings(nn.Linear(16, V + 8, bias=False))
            m.config.vocab_size = V + 8
            return m
    ''',
}


@pytest.mark.parametrize("how", [pytest.param(h, marks=() if i == 0 else pytest.mark.slow)
                                 for i, h in enumerate(RESIZED)])
def test_a_tie_lost_by_a_resize_is_named(tmp_path: Path, how: str) -> None:
    # was exit 2, from the model's own forward (a reshape, or a target out of bounds)
    rep = check(tmp_path, f"cm_resize_{how.replace('-', '_')}",
                textwrap.dedent(RESIZE) + textwrap.dedent(RESIZED[how]), only="one-token-repeated")
    assert_wrong(rep, "tie_lost")
    found = details(rep, "tie discovered")
    assert found and all("resize_token_embeddings" in d and f"{41 + 8}" in d and "41" in d
                         for d in found), summary(rep)


@pytest.mark.slow
def test_a_resize_that_keeps_the_tie_is_correct(tmp_path: Path) -> None:
    rep = check(tmp_path, "cm_resize_kept", textwrap.dedent(RESIZE) + textwrap.dedent('''
        def make_model():
            m = gpt2()
            m.resize_token_embeddings(V + 8, mean_resizing=False)
            return m
    '''), only="one-token-repeated")
    assert_correct(rep)


# --- LED and Longformer ------------------------------------------------------------------------

TESTER_CONFIGS = '''
    from transformers import (
        LEDConfig,
        LEDForConditionalGeneration,
        LongformerConfig,
        LongformerForMaskedLM,
    )


    def led():
        """transformers' LEDModelTester configuration."""
        return LEDForConditionalGeneration(LEDConfig(
            vocab_size=99, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4,
            decoder_ffn_dim=4, dropout=0.1, attention_dropout=0.1, max_position_embeddings=32,
            eos_token_id=2, pad_token_id=1, bos_token_id=0, attention_window=4))


    def longformer():
        """transformers' LongformerModelTester configuration."""
        return LongformerForMaskedLM(LongformerConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=16,
            initializer_range=0.02, attention_window=4))


    # 13 positions: the attention pads them to 16, and the float64 backward is NaN there
    led_padded = TorchTarget(model=led, seq_len=13)
    longformer_padded = TorchTarget(model=longformer, seq_len=13)
'''


@pytest.mark.slow
@pytest.mark.parametrize("attr", ["led_padded", "longformer_padded"])
def test_led_and_longformer_train_in_float32_and_are_checked_there(tmp_path: Path,
                                                                   attr: str) -> None:
    # was exit 1 (unknown): the optimizer check built a float64 model, whose backward is NaN
    rep = check(tmp_path, "cm_tester_configs", TESTER_CONFIGS, attr)
    assert_correct(rep)
