"""A zoo of real architectures for the torch kind, each a zero-argument factory.

Three families, all built from tiny configs (nothing is downloaded):

* transformers models with a tied embedding (``tie_word_embeddings=True``), correct, and the
  same architectures with ``tie_word_embeddings=False`` (no tie: ``tyingspec check`` must exit 2,
  "found no tie");
* from-scratch models written to the conventions of popular from-scratch repositories
  (minGPT's lambda attribute, LLMs-from-scratch's ``cfg["dtype"]`` casts, a Mamba-style
  ``.float()`` head, a scaling ``nn.Embedding`` subclass, torchtune's ``TiedLinear``, a custom
  ``autograd.Function`` lookup, CTRL's in-place scaling, keyword-only ``targets``, an
  x-transformers ``return_embeddings`` flag), each with a correct gradient;
* broken variants of five transformers architectures: a detached lookup output (the input
  path is dropped), a lookup whose backward keeps one occurrence per repeated token, and a
  copy tie (the head given its own Parameter while the config still declares the tie).

Every size is tiny: vocabulary 97 (not a power of two), width 32 (16 for a few), 1-2 layers,
2 heads, context >= 64; LED and Longformer keep transformers' own tester configurations.
Dropout probabilities stay at each config's defaults, so a checker must handle a model built
in train mode.  Each factory is deterministic given
``torch.manual_seed``; none seeds itself.

:data:`ZOO` lists every entry with what ``tyingspec check zoos.transformers_zoo:<factory>
--kind torch`` must return.  Importing this module imports torch but not transformers (each
transformers factory imports it on its first call).
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tyingspec import TorchTarget

V = 97  # not a power of two
D = 32
HEADS = 2
FF = 64
CTX = 64
LAYERS = 2


@dataclass(frozen=True)
class ZooEntry:
    """One architecture: its factory (this module's attribute ``factory``) and the verdict."""

    name: str
    factory: str
    kind: str  # "correct", "untied", "broken" or "no-power" (correct, no check can tell)
    expected_exit: int  # 0 correct, 1 wrong gradient, 2 no tie
    #: broken: the labels the verdict may name (any one); untied: ("found no tie",), the error
    expected_labels: tuple[str, ...] = ()
    encoder_decoder: bool = False
    masked_lm: bool = False
    notes: str = ""


def _hf(model_cls: str, config_cls: str, **config: Any) -> Callable[[], nn.Module]:
    """A factory building ``transformers.<model_cls>(<config_cls>(**config))``."""

    def factory() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        model: nn.Module = getattr(transformers, model_cls)(cfg)
        return model

    factory.__name__ = factory.__qualname__ = f"make_{model_cls}"
    factory.__doc__ = f"transformers.{model_cls}({config_cls}(**{config!r}))"
    return factory


# Shared tiny settings of Llama-like configs (hidden_size / num_attention_heads / ...).
_LLAMA_LIKE: dict[str, Any] = dict(vocab_size=V, hidden_size=D, intermediate_size=FF,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=HEADS, max_position_embeddings=CTX)
_TIED: dict[str, Any] = dict(tie_word_embeddings=True)
_UNTIED: dict[str, Any] = dict(tie_word_embeddings=False)
_ENC_DEC: dict[str, Any] = dict(vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
                                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                encoder_ffn_dim=FF, decoder_ffn_dim=FF,
                                max_position_embeddings=CTX)
_BERT_LIKE: dict[str, Any] = dict(vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=FF)

# --- tied transformers architectures (correct) -------------------------------------------------

gpt2 = _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=V, n_positions=CTX, n_embd=D,
           n_layer=LAYERS, n_head=HEADS, n_inner=FF, bos_token_id=V - 1, eos_token_id=V - 1,
           **_TIED)
gpt_neo = _hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=V, max_position_embeddings=CTX,
              hidden_size=D, num_layers=LAYERS, num_heads=HEADS, intermediate_size=FF,
              attention_types=[[["global", "local"], 1]], window_size=8, **_TIED)
gptj = _hf("GPTJForCausalLM", "GPTJConfig", vocab_size=V, n_positions=CTX, n_embd=D,
           n_layer=LAYERS, n_head=HEADS, n_inner=FF, rotary_dim=8, **_TIED)
gpt_neox = _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=V, hidden_size=D,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF,
               max_position_embeddings=CTX, **_TIED)
bloom = _hf("BloomForCausalLM", "BloomConfig", vocab_size=V, hidden_size=D, n_layer=LAYERS,
            n_head=HEADS, **_TIED)
falcon = _hf("FalconForCausalLM", "FalconConfig", vocab_size=V, hidden_size=D,
             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             max_position_embeddings=CTX, **_TIED)
ctrl = _hf("CTRLLMHeadModel", "CTRLConfig", vocab_size=V, n_positions=CTX, n_embd=D, dff=FF,
           n_layer=LAYERS, n_head=HEADS, **_TIED)
biogpt = _hf("BioGptForCausalLM", "BioGptConfig", vocab_size=V, hidden_size=D,
             num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF,
             max_position_embeddings=CTX, **_TIED)
xglm = _hf("XGLMForCausalLM", "XGLMConfig", vocab_size=V, max_position_embeddings=CTX,
           d_model=D, ffn_dim=FF, num_layers=LAYERS, attention_heads=HEADS, **_TIED)
opt = _hf("OPTForCausalLM", "OPTConfig", vocab_size=V, hidden_size=D, word_embed_proj_dim=16,
          ffn_dim=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
          max_position_embeddings=CTX, **_TIED)
codegen = _hf("CodeGenForCausalLM", "CodeGenConfig", vocab_size=V, n_positions=CTX, n_ctx=CTX,
              n_embd=D, n_layer=LAYERS, n_head=HEADS, n_inner=FF, rotary_dim=8, **_TIED)
mpt = _hf("MptForCausalLM", "MptConfig", vocab_size=V, d_model=D, n_heads=HEADS,
          n_layers=LAYERS, expansion_ratio=2, max_seq_len=CTX, **_TIED)
llama = _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_LIKE, **_TIED)
mistral = _hf("MistralForCausalLM", "MistralConfig", **_LLAMA_LIKE, **_TIED)
qwen2 = _hf("Qwen2ForCausalLM", "Qwen2Config", **_LLAMA_LIKE, **_TIED)
qwen3 = _hf("Qwen3ForCausalLM", "Qwen3Config", **_LLAMA_LIKE, head_dim=16, **_TIED)
phi = _hf("PhiForCausalLM", "PhiConfig", **_LLAMA_LIKE, partial_rotary_factor=0.5, **_TIED)
phi3 = _hf("Phi3ForCausalLM", "Phi3Config", **_LLAMA_LIKE, pad_token_id=0, bos_token_id=1,
           eos_token_id=2, **_TIED)
stablelm = _hf("StableLmForCausalLM", "StableLmConfig", **_LLAMA_LIKE, **_TIED)
starcoder2 = _hf("Starcoder2ForCausalLM", "Starcoder2Config", **_LLAMA_LIKE, **_TIED)
olmo = _hf("OlmoForCausalLM", "OlmoConfig", **_LLAMA_LIKE, pad_token_id=0, eos_token_id=2,
           **_TIED)
olmo2 = _hf("Olmo2ForCausalLM", "Olmo2Config", **_LLAMA_LIKE, pad_token_id=0, **_TIED)
persimmon = _hf("PersimmonForCausalLM", "PersimmonConfig", vocab_size=V, hidden_size=D,
                intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                max_position_embeddings=CTX, **_TIED)
nemotron = _hf("NemotronForCausalLM", "NemotronConfig", **_LLAMA_LIKE, head_dim=16,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, **_TIED)
cohere = _hf("CohereForCausalLM", "CohereConfig", **_LLAMA_LIKE, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, **_TIED)
cohere2 = _hf("Cohere2ForCausalLM", "Cohere2Config", **_LLAMA_LIKE, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, sliding_window=8, **_TIED)
granite = _hf("GraniteForCausalLM", "GraniteConfig", **_LLAMA_LIKE, **_TIED)
glm = _hf("GlmForCausalLM", "GlmConfig", **_LLAMA_LIKE, head_dim=16, pad_token_id=0,
          eos_token_id=2, **_TIED)
helium = _hf("HeliumForCausalLM", "HeliumConfig", **_LLAMA_LIKE, head_dim=16, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, **_TIED)
gemma = _hf("GemmaForCausalLM", "GemmaConfig", **_LLAMA_LIKE, head_dim=16, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, **_TIED)
gemma2 = _hf("Gemma2ForCausalLM", "Gemma2Config", **_LLAMA_LIKE, head_dim=16,
             query_pre_attn_scalar=16, sliding_window=8, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, **_TIED)
gemma3 = _hf("Gemma3ForCausalLM", "Gemma3TextConfig", **_LLAMA_LIKE, head_dim=16,
             query_pre_attn_scalar=16, sliding_window=8, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, **_TIED)


def gemma3_composite() -> nn.Module:
    """transformers' Gemma3ForConditionalGeneration (a language model beside a SigLIP vision
    tower): its pad token is named in ``config.text_config`` and in the language model's own
    config, not on the top-level config, and its lookup declares ``padding_idx`` = 0."""
    import transformers

    text = dict(**_LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, **_TIED)
    vision = dict(model_type="siglip_vision_model", hidden_size=D, intermediate_size=FF,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, image_size=32,
                  patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, **_TIED)
    model: nn.Module = transformers.Gemma3ForConditionalGeneration(cfg)
    return model


fuyu_composite = _hf("FuyuForCausalLM", "FuyuConfig", text_config=dict(
    model_type="persimmon", vocab_size=V, hidden_size=D, intermediate_size=FF,
    num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=CTX,
    pad_token_id=0), vocab_size=V, hidden_size=D, patch_size=4, num_channels=3, **_TIED)

prophetnet = _hf("ProphetNetForCausalLM", "ProphetNetConfig", vocab_size=V, hidden_size=D,
                 num_encoder_layers=1, num_decoder_layers=LAYERS, num_encoder_attention_heads=HEADS,
                 num_decoder_attention_heads=HEADS, encoder_ffn_dim=FF, decoder_ffn_dim=FF,
                 max_position_embeddings=CTX, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=0, **_TIED)
def minicpm5_moe() -> nn.Module:
    """transformers' MiniCPM5MoeForCausalLM, which runs in float32 only (its grouped expert
    matmul has no float64 kernel).  It seeds its own initialisation, unlike the rest of the
    zoo: at this one, the forward check's larger steps switch experts along one direction of
    the repeated-tokens case (no row confirms it), which a sweep of transformers 5.25's
    causal-LM architectures saw as a false alarm."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MiniCPM5MoeConfig(
        **{**_LLAMA_LIKE, "max_position_embeddings": 2 * CTX}, head_dim=16,
        moe_intermediate_size=16, num_experts_per_tok=2, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=3.66, n_group=1, topk_group=1,
        norm_topk_prob=True, mlp_layer_types=["dense", "sparse"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2, **_TIED)
    torch.manual_seed(0)
    model: nn.Module = transformers.MiniCPM5MoeForCausalLM(cfg)
    return model


mixtral = _hf("MixtralForCausalLM", "MixtralConfig", **_LLAMA_LIKE, num_local_experts=4,
              num_experts_per_tok=2, **_TIED)
qwen2_moe = _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_LLAMA_LIKE, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, decoder_sparse_step=1, **_TIED)
phimoe = _hf("PhimoeForCausalLM", "PhimoeConfig", **_LLAMA_LIKE, num_local_experts=4,
             num_experts_per_tok=2, **_TIED)
olmoe = _hf("OlmoeForCausalLM", "OlmoeConfig", **_LLAMA_LIKE, num_experts=4,
            num_experts_per_tok=2, pad_token_id=0, **_TIED)
qwen3_moe = _hf("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_LLAMA_LIKE, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, **_TIED)
granitemoe = _hf("GraniteMoeForCausalLM", "GraniteMoeConfig", **_LLAMA_LIKE,
                 num_local_experts=4, num_experts_per_tok=2, **_TIED)
gpt_oss = _hf("GptOssForCausalLM", "GptOssConfig", **_LLAMA_LIKE, num_local_experts=4,
              num_experts_per_tok=2, head_dim=16, **_TIED)
deepseek_v3 = _hf("DeepseekV3ForCausalLM", "DeepseekV3Config", **_LLAMA_LIKE,
                  moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                  kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, **_TIED)
# Added 2026-12-05 after a sweep of transformers 5.25's causal LMs outside this zoo (each checked
# correct by `tyingspec check --kind torch` first): multiplier, soft-capping and hybrid
# conventions the entries above do not have.
gpt_bigcode = _hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=V, n_positions=CTX,
                  n_embd=D, n_layer=LAYERS, n_head=HEADS, multi_query=True, **_TIED)
lfm2 = _hf("Lfm2ForCausalLM", "Lfm2Config", **_LLAMA_LIKE,
           layer_types=["conv", "full_attention"], **_TIED)
falcon_h1 = _hf("FalconH1ForCausalLM", "FalconH1Config", **_LLAMA_LIKE, head_dim=16,
                mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
                mamba_chunk_size=16, embedding_multiplier=2.5, lm_head_multiplier=0.75,
                **_TIED)
hyperclovax = _hf("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", **_LLAMA_LIKE,
                  embedding_multiplier=2.0, logits_scaling=0.5, **_TIED)
nanochat = _hf("NanoChatForCausalLM", "NanoChatConfig", **_LLAMA_LIKE,
               final_logit_softcapping=15.0, **_TIED)
vaultgemma = _hf("VaultGemmaForCausalLM", "VaultGemmaConfig", **_LLAMA_LIKE, head_dim=16,
                 pad_token_id=0, **_TIED)
llama4_text = _hf("Llama4ForCausalLM", "Llama4TextConfig", **_LLAMA_LIKE, head_dim=16,
                  intermediate_size_mlp=FF, num_local_experts=4, num_experts_per_tok=1,
                  **_TIED)
glm4_moe = _hf("Glm4MoeForCausalLM", "Glm4MoeConfig", **_LLAMA_LIKE, head_dim=16,
               moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, first_k_dense_replace=1, **_TIED)
bitnet = _hf("BitNetForCausalLM", "BitNetConfig", **_LLAMA_LIKE, **_TIED)
diffllama = _hf("DiffLlamaForCausalLM", "DiffLlamaConfig", **_LLAMA_LIKE, **_TIED)
mamba = _hf("MambaForCausalLM", "MambaConfig", vocab_size=V, hidden_size=D, state_size=8,
            num_hidden_layers=LAYERS, expand=2, conv_kernel=4, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **_TIED)
mamba2 = _hf("Mamba2ForCausalLM", "Mamba2Config", vocab_size=V, hidden_size=D, state_size=8,
             num_hidden_layers=LAYERS, expand=2, conv_kernel=4, num_heads=4, head_dim=16,
             n_groups=1, chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             **_TIED)
falcon_mamba = _hf("FalconMambaForCausalLM", "FalconMambaConfig", vocab_size=V, hidden_size=D,
                   state_size=8, num_hidden_layers=LAYERS, expand=2, conv_kernel=4,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2, **_TIED)
rwkv = _hf("RwkvForCausalLM", "RwkvConfig", vocab_size=V, context_length=CTX, hidden_size=D,
           num_hidden_layers=LAYERS, attention_hidden_size=D, intermediate_size=FF, **_TIED)
bart = _hf("BartForConditionalGeneration", "BartConfig", **_ENC_DEC, **_TIED)
mbart = _hf("MBartForConditionalGeneration", "MBartConfig", **_ENC_DEC, **_TIED)
marian = _hf("MarianMTModel", "MarianConfig", **_ENC_DEC, pad_token_id=V - 1,
             eos_token_id=0, decoder_start_token_id=V - 1, **_TIED)
pegasus = _hf("PegasusForConditionalGeneration", "PegasusConfig", **_ENC_DEC, pad_token_id=0,
              eos_token_id=1, decoder_start_token_id=0, **_TIED)
t5 = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=V, d_model=D, d_kv=16, d_ff=FF,
         num_layers=1, num_decoder_layers=1, num_heads=HEADS,
         relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
         eos_token_id=1, **_TIED)
bert_mlm = _hf("BertForMaskedLM", "BertConfig", **_BERT_LIKE, max_position_embeddings=CTX,
               **_TIED)
roberta_mlm = _hf("RobertaForMaskedLM", "RobertaConfig", **_BERT_LIKE,
                  max_position_embeddings=CTX + 2, **_TIED)

# transformers' own tester configurations (LEDModelTester, LongformerModelTester in
# tests/models/{led,longformer}/test_modeling_*.py), sizes as they are.  Longformer attention
# pads a sequence to a multiple of 2 x attention_window; through that padding the float64
# backward is NaN in some entries, while in float32, the dtype they train in, it is finite.
led = _hf("LEDForConditionalGeneration", "LEDConfig", vocab_size=99, d_model=16,
          encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
          decoder_attention_heads=4, encoder_ffn_dim=4, decoder_ffn_dim=4, dropout=0.1,
          attention_dropout=0.1, max_position_embeddings=32, eos_token_id=2, pad_token_id=1,
          bos_token_id=0, attention_window=4)
longformer_mlm = _hf("LongformerForMaskedLM", "LongformerConfig", vocab_size=99,
                     hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, max_position_embeddings=512,
                     type_vocab_size=16, initializer_range=0.02, attention_window=4)
# 13 positions, which the attention pads to 16: where the float64 backward is NaN
led_padded = TorchTarget(model=led, seq_len=13)
longformer_mlm_padded = TorchTarget(model=longformer_mlm, seq_len=13)

# --- untied transformers architectures (no tie: exit 2) ----------------------------------------

llama_untied = _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_LIKE, **_UNTIED)
mistral_untied = _hf("MistralForCausalLM", "MistralConfig", **_LLAMA_LIKE, **_UNTIED)
qwen2_untied = _hf("Qwen2ForCausalLM", "Qwen2Config", **_LLAMA_LIKE, **_UNTIED)
gpt_neox_untied = _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=V, hidden_size=D,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=FF, max_position_embeddings=CTX, **_UNTIED)
phi_untied = _hf("PhiForCausalLM", "PhiConfig", **_LLAMA_LIKE, partial_rotary_factor=0.5,
                 **_UNTIED)
bert_mlm_untied = _hf("BertForMaskedLM", "BertConfig", **_BERT_LIKE,
                      max_position_embeddings=CTX, **_UNTIED)


# --- from-scratch convention models (correct) --------------------------------------------------

def _causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf"))
    return F.softmax(att, dim=-1) @ v


class _SelfAttention(nn.Module):
    """minGPT's CausalSelfAttention: one c_attn, then c_proj."""

    def __init__(self, d: int, n_head: int, pdrop: float = 0.1) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(pdrop)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = _causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MinGPTBlock(nn.Module):
    """minGPT's Block, down to ``self.mlpf``: a lambda stored as an attribute, closing over
    ``self.mlp`` (so ``copy.deepcopy`` keeps a function that calls the original's weights)."""

    def __init__(self, d: int, n_head: int, pdrop: float = 0.1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _SelfAttention(d, n_head, pdrop)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d), c_proj=nn.Linear(4 * d, d),
                                      act=nn.GELU(), dropout=nn.Dropout(pdrop)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))  # MLP forward

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class MinGPT(nn.Module):
    """minGPT's GPT (``forward(idx, targets=None) -> (logits, loss)``), tied like nanoGPT."""

    def __init__(self, vocab_size: int = V, block_size: int = CTX, n_embd: int = D,
                 n_head: int = HEADS, n_layer: int = LAYERS, pdrop: float = 0.1) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(pdrop),
            h=nn.ModuleList([MinGPTBlock(n_embd, n_head, pdrop) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: Tensor, targets: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def mingpt_lambda() -> nn.Module:
    return MinGPT()


# LLMs-from-scratch (rasbt) Llama 3: a config dict, every layer built with dtype=cfg["dtype"],
# and the head's input cast to cfg["dtype"].

def _compute_rope_params(head_dim: int, theta_base: float, context_length: int
                         ) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float()
                                     / head_dim))
    positions = torch.arange(context_length)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    _, _, seq_len, head_dim = x.shape
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    cos = cos[:seq_len, :].unsqueeze(0).unsqueeze(0)
    sin = sin[:seq_len, :].unsqueeze(0).unsqueeze(0)
    rotated = torch.cat((-x2, x1), dim=-1)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, emb_dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        means = x.float().pow(2).mean(dim=-1, keepdim=True)
        norm_x = x.float() * torch.rsqrt(means + self.eps)
        return (norm_x * self.weight).to(dtype=x.dtype)


class _GroupedQueryAttention(nn.Module):
    def __init__(self, d_in: int, d_out: int, num_heads: int, num_kv_groups: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_query = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)

    def forward(self, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim)
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
        keys, queries = _apply_rope(keys, cos, sin), _apply_rope(queries, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores = attn_scores.masked_fill(mask[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2)
        return self.out_proj(context.reshape(b, num_tokens, self.num_heads * self.head_dim))


class _FeedForward(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], dtype=cfg["dtype"], bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))


class _LlamaBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.att = _GroupedQueryAttention(cfg["emb_dim"], cfg["emb_dim"], cfg["n_heads"],
                                          cfg["n_kv_groups"], dtype=cfg["dtype"])
        self.ff = _FeedForward(cfg)
        self.norm1 = _RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.norm2 = _RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])

    def forward(self, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.att(self.norm1(x), mask, cos, sin)
        return x + self.ff(self.norm2(x))


class ScratchLlama3(nn.Module):
    """LLMs-from-scratch's ``Llama3Model(cfg)``, tied by assignment as its weight loader does
    for the 1B model (``model.out_head.weight = model.tok_emb.weight``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList([_LlamaBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = _RMSNorm(cfg["emb_dim"], eps=1e-5, dtype=cfg["dtype"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False,
                                  dtype=cfg["dtype"])
        self.out_head.weight = self.tok_emb.weight
        mask = torch.triu(torch.ones(cfg["context_length"], cfg["context_length"]), diagonal=1)
        self.register_buffer("mask", mask.bool(), persistent=False)
        cos, sin = _compute_rope_params(cfg["emb_dim"] // cfg["n_heads"], cfg["rope_base"],
                                        cfg["context_length"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, in_idx: Tensor) -> Tensor:
        x = self.tok_emb(in_idx)
        for block in self.trf_blocks:
            x = block(x, self.mask, self.cos, self.sin)
        x = self.final_norm(x)
        return self.out_head(x.to(self.cfg["dtype"]))


def _scratch_llama_cfg(dtype: torch.dtype) -> dict[str, Any]:
    return {"vocab_size": V, "context_length": CTX, "emb_dim": D, "n_heads": HEADS,
            "n_layers": LAYERS, "hidden_dim": FF, "n_kv_groups": 1, "rope_base": 500_000.0,
            "dtype": dtype}


def scratch_llama_fp32() -> nn.Module:
    return ScratchLlama3(_scratch_llama_cfg(torch.float32))


def scratch_llama_bf16() -> nn.Module:
    return ScratchLlama3(_scratch_llama_cfg(torch.bfloat16))


MambaOutput = namedtuple("MambaOutput", ["logits"])


class _MambaMixer(nn.Module):
    """A gated causal-convolution mixer with a diagonal linear recurrence (a tiny SSM)."""

    def __init__(self, d: int, expand: int = 2, d_conv: int = 4,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        inner = expand * d
        self.in_proj = nn.Linear(d, 2 * inner, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(inner, inner, d_conv, groups=inner, padding=d_conv - 1,
                                dtype=dtype)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 4.0, inner)).to(dtype))
        self.out_proj = nn.Linear(inner, d, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        T = x.size(1)
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv1d(u.transpose(1, 2))[..., :T].transpose(1, 2))
        decay = torch.exp(-torch.exp(self.A_log))
        state = torch.zeros_like(u[:, 0])
        ys = []
        for t in range(T):
            state = decay * state + u[:, t]
            ys.append(state)
        y = torch.stack(ys, dim=1) * F.silu(z)
        return self.out_proj(y)


class MambaStyleLM(nn.Module):
    """mamba_ssm's ``MambaLMHeadModel`` layout (``backbone.embedding``, ``lm_head`` tied) with
    transformers' head convention: ``lm_head(h.to(lm_head.weight.dtype)).float()``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.embedding = nn.Embedding(V, D, dtype=dtype)
        self.backbone.layers = nn.ModuleList([_MambaMixer(D, dtype=dtype) for _ in range(LAYERS)])
        self.backbone.norm_f = _RMSNorm(D, dtype=dtype)
        self.lm_head = nn.Linear(D, V, bias=False, dtype=dtype)
        self.lm_head.weight = self.backbone.embedding.weight

    def forward(self, input_ids: Tensor) -> MambaOutput:
        h = self.backbone.embedding(input_ids)
        for layer in self.backbone.layers:
            h = h + layer(h)
        h = self.backbone.norm_f(h)
        return MambaOutput(logits=self.lm_head(h.to(self.lm_head.weight.dtype)).float())


def mamba_style_fp32() -> nn.Module:
    return MambaStyleLM(torch.float32)


def mamba_style_bf16() -> nn.Module:
    return MambaStyleLM(torch.bfloat16)


class _PlainBlock(nn.Module):
    """nanoGPT's Block: the MLP is a method call (no lambda attribute), so that each model
    below tries one convention only."""

    def __init__(self, d: int, n_head: int, pdrop: float = 0.1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _SelfAttention(d, n_head, pdrop)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(pdrop)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class _TinyBody(nn.Module):
    """A causal body (one nanoGPT block) shared by the small from-scratch models below."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.wpe = nn.Embedding(CTX, d)
        self.blocks = nn.ModuleList([_PlainBlock(d, HEADS, pdrop=0.1) for _ in range(1)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


class ScaledEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose output is scaled by sqrt(d) (Gemma's, T5X's convention)."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * math.sqrt(self.embedding_dim)


class ScaledEmbeddingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ScaledEmbedding(V, D)
        self.body = _TinyBody()
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.body(self.embed(idx)))


def scaled_embedding_subclass() -> nn.Module:
    return ScaledEmbeddingLM()


class TiedLinear:
    """torchtune's ``TiedLinear`` (torchtune/modules/tied_linear.py): a plain object, not an
    ``nn.Module``, holding the embedding module and calling ``F.linear`` on its weight."""

    def __init__(self, tied_module: nn.Module) -> None:
        self.tied_module = tied_module
        self.linear = F.linear
        if not hasattr(tied_module, "weight"):
            raise AttributeError("Provided module does not have attribute 'weight'.")

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x, self.tied_module.weight)


class TiedLinearModule(nn.Module):
    """The same head as an ``nn.Module`` (the embedding then registered under it too)."""

    def __init__(self, tied_module: nn.Module) -> None:
        super().__init__()
        self.tied_module = tied_module

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.tied_module.weight)


class TorchtuneDecoder(nn.Module):
    """torchtune's ``TransformerDecoder`` layout: ``tok_embeddings``, ``output`` a TiedLinear,
    keyword-only extras in ``forward`` and ``.float()`` logits."""

    def __init__(self, as_module: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = _TinyBody()
        self.norm = _RMSNorm(D)
        self.output: Callable[[Tensor], Tensor] = (
            TiedLinearModule(self.tok_embeddings) if as_module else TiedLinear(self.tok_embeddings))

    def forward(self, tokens: Tensor, *, mask: Tensor | None = None,
                input_pos: Tensor | None = None) -> Tensor:
        h = self.norm(self.layers(self.tok_embeddings(tokens)))
        return self.output(h).float()


def torchtune_tied_linear() -> nn.Module:
    return TorchtuneDecoder(as_module=False)


def torchtune_tied_linear_module() -> nn.Module:
    return TorchtuneDecoder(as_module=True)


class IndexAddLookup(torch.autograd.Function):
    """An embedding lookup with a hand-written backward that scatter-adds (correct)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.size(0)
        return weight[ids]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[None, Tensor]:
        (ids,) = ctx.saved_tensors
        flat = grad_out.reshape(-1, grad_out.size(-1))
        grad = torch.zeros(ctx.num_rows, flat.size(1), dtype=grad_out.dtype,
                           device=grad_out.device)
        grad.index_add_(0, ids.reshape(-1), flat)
        return None, grad


class LastOnlyLookup(torch.autograd.Function):
    """A lookup whose backward writes with ``index_copy_``: a repeated token keeps one
    occurrence's gradient (pytorch #1528, numpy's buffered ``a[idx] += v``)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.size(0)
        return weight[ids]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[None, Tensor]:
        (ids,) = ctx.saved_tensors
        flat = grad_out.reshape(-1, grad_out.size(-1))
        grad = torch.zeros(ctx.num_rows, flat.size(1), dtype=grad_out.dtype,
                           device=grad_out.device)
        grad.index_copy_(0, ids.reshape(-1), flat)
        return None, grad


class CustomLookupLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.body = _TinyBody()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.lm_head(self.body(IndexAddLookup.apply(idx, self.wte.weight)))


def custom_function_lookup() -> nn.Module:
    return CustomLookupLM()


class InplaceScaledLM(nn.Module):
    """CTRL's ``inputs_embeds = self.w(input_ids); inputs_embeds *= np.sqrt(d)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Embedding(V, D)
        self.body = _TinyBody()
        self.lm_head = nn.Linear(D, V, bias=True)
        self.lm_head.weight = self.w.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.w(idx)
        x *= math.sqrt(D)
        return self.lm_head(self.body(x))


def inplace_scaled_lookup() -> nn.Module:
    return InplaceScaledLM()


class KeywordTargetsLM(nn.Module):
    """nanoGPT's ``(logits, loss)`` convention with ``targets`` keyword-only."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.body = _TinyBody()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: Tensor, *, targets: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        logits = self.lm_head(self.body(self.wte(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def keyword_only_targets() -> nn.Module:
    return KeywordTargetsLM()


class ReturnEmbeddingsLM(nn.Module):
    """x-transformers' ``TransformerWrapper.forward(x, return_embeddings=False, ...)``: the
    second parameter is a flag, not the targets."""

    def __init__(self) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(V, D)
        self.attn_layers = _TinyBody()
        self.to_logits = nn.Linear(D, V, bias=False)
        self.to_logits.weight = self.token_emb.weight

    def forward(self, x: Tensor, return_embeddings: bool = False,
                mask: Tensor | None = None) -> Tensor:
        h = self.attn_layers(self.token_emb(x))
        if return_embeddings:
            return h
        return self.to_logits(h)


def return_embeddings_flag() -> nn.Module:
    return ReturnEmbeddingsLM()


# --- broken variants of transformers architectures ---------------------------------------------

def _tied_weight(model: nn.Module) -> nn.Parameter:
    W = model.get_input_embeddings().weight  # type: ignore[operator]
    assert W is model.get_output_embeddings().weight  # type: ignore[operator]
    return W


_SUBCLASSES: dict[tuple[str, type[nn.Module]], type[nn.Module]] = {}


def _swap_class(module: nn.Module, bug: str) -> None:
    """Give ``module`` a subclass of its own class whose forward has ``bug``; the subclass is
    kept in this module's namespace so that the model still pickles."""
    base = type(module)
    key = (bug, base)
    if key not in _SUBCLASSES:
        name = f"_{bug.title().replace('_', '')}{base.__name__}"
        if bug == "detached":
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return base.forward(self, *args, **kwargs).detach()
        else:
            def forward(self: nn.Module, input_ids: Tensor, *args: Any, **kwargs: Any) -> Any:
                out = LastOnlyLookup.apply(input_ids, self.weight)
                scale = getattr(self, "embed_scale", None)  # the scaled embeddings' factor
                if isinstance(scale, Tensor):
                    scale = scale.to(out.dtype)
                return out if scale is None else out * scale
        sub = type(name, (base,), {"forward": forward, "__module__": __name__,
                                   "__qualname__": name})
        globals()[name] = sub
        _SUBCLASSES[key] = sub
    module.__class__ = _SUBCLASSES[key]


def _lookups_of(model: nn.Module, W: nn.Parameter) -> list[nn.Module]:
    """Every module that looks rows of W up (three in an encoder-decoder, one otherwise)."""
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is W]


def _input_detached(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model with each lookup of the tied matrix returning a detached value: the tie is
    kept, but the input path carries no gradient (TransformerEngine #3437's shape)."""

    def make() -> nn.Module:
        model = factory()
        W = _tied_weight(model)
        for m in _lookups_of(model, W):
            _swap_class(m, "detached")
        return model

    return make


def _duplicates_lost(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model with each lookup of the tied matrix going through :class:`LastOnlyLookup`."""

    def make() -> nn.Module:
        model = factory()
        W = _tied_weight(model)
        for m in _lookups_of(model, W):
            _swap_class(m, "last_only")
        return model

    return make


def _copy_tie(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The head given its own ``nn.Parameter(embedding.weight.clone())``: equal at the start,
    two Parameters, while the config still says ``tie_word_embeddings=True``."""

    def make() -> nn.Module:
        model = factory()
        W = _tied_weight(model)
        head = model.get_output_embeddings()  # type: ignore[operator]
        head.weight = nn.Parameter(W.detach().clone())
        assert model.config.tie_word_embeddings  # type: ignore[union-attr]
        return model

    return make


gpt2_input_detached = _input_detached(gpt2)
gpt2_duplicates_lost = _duplicates_lost(gpt2)
gpt2_copy_tie = _copy_tie(gpt2)
llama_input_detached = _input_detached(llama)
llama_duplicates_lost = _duplicates_lost(llama)
llama_copy_tie = _copy_tie(llama)
gemma_input_detached = _input_detached(gemma)
gemma_duplicates_lost = _duplicates_lost(gemma)
gemma_copy_tie = _copy_tie(gemma)
bart_input_detached = _input_detached(bart)
bart_duplicates_lost = _duplicates_lost(bart)
bart_copy_tie = _copy_tie(bart)
t5_input_detached = _input_detached(t5)
t5_duplicates_lost = _duplicates_lost(t5)
t5_copy_tie = _copy_tie(t5)
opt_input_detached = _input_detached(opt)
opt_duplicates_lost = _duplicates_lost(opt)
opt_copy_tie = _copy_tie(opt)
falcon_h1_input_detached = _input_detached(falcon_h1)
falcon_h1_duplicates_lost = _duplicates_lost(falcon_h1)
falcon_h1_copy_tie = _copy_tie(falcon_h1)
hyperclovax_input_detached = _input_detached(hyperclovax)
hyperclovax_duplicates_lost = _duplicates_lost(hyperclovax)
hyperclovax_copy_tie = _copy_tie(hyperclovax)


# --- the registry ------------------------------------------------------------------------------

def _correct(name: str, factory: str, notes: str = "", *, encoder_decoder: bool = False,
             masked_lm: bool = False) -> ZooEntry:
    return ZooEntry(name, factory, "correct", 0, (), encoder_decoder, masked_lm, notes)


def _untied(name: str, factory: str, notes: str = "", *, masked_lm: bool = False) -> ZooEntry:
    return ZooEntry(name, factory, "untied", 2, ("found no tie",), False, masked_lm,
                    notes or "tie_word_embeddings=False")


_BROKEN_LABELS = {"input_detached": ("input_path_missing", "input_path_wrong"),
                  "duplicates_lost": ("duplicates_not_accumulated",),
                  "copy_tie": ("tie_is_a_copy",)}
#: The bugs each broken architecture is built with; a broken factory is ``<arch>_<bug>``.
BUGS = tuple(_BROKEN_LABELS)
_BROKEN_NOTES = {"input_detached": "every lookup of the tied matrix returns a detached value",
                 "duplicates_lost": "lookup backward uses index_copy_ (one occurrence kept)",
                 "copy_tie": "head holds nn.Parameter(embedding.weight.clone())"}


def _broken(arch: str, bug: str, *, encoder_decoder: bool = False) -> ZooEntry:
    factory = f"{arch}_{bug}"
    labels = _BROKEN_LABELS[bug]
    if encoder_decoder and bug == "duplicates_lost":
        # each of the encoder's and the decoder's lookups keeps one occurrence per call; the
        # diagnosis pools both calls' positions, so where a token repeats across the two but
        # within neither, the pattern it can name is "present rows wrong, absent ones exact"
        labels = (*labels, "input_path_wrong")
    return ZooEntry(factory.replace("_", "-"), factory, "broken", 1, labels,
                    encoder_decoder, False, _BROKEN_NOTES[bug])


ZOO: tuple[ZooEntry, ...] = (
    _correct("gpt2", "gpt2"),
    _correct("gpt-neo", "gpt_neo", "global and local attention layers"),
    _correct("gpt-j", "gptj", "tie_word_embeddings defaults to False; lm_head has a bias"),
    _correct("gpt-neox", "gpt_neox", "head is embed_out; tie defaults to False"),
    _correct("bloom", "bloom", "alibi; word_embeddings_layernorm"),
    _correct("falcon", "falcon"),
    _correct("ctrl", "ctrl", "in-place x *= sqrt(d) after the lookup; lm_head has a bias"),
    _correct("biogpt", "biogpt", "scale_embedding: lookup scaled by sqrt(d)"),
    _correct("xglm", "xglm", "scaled lookup; float32 finfo.min mask"),
    _correct("opt", "opt", "word_embed_proj_dim=16 != hidden_size=32 (project_in/out)"),
    _correct("codegen", "codegen", "tie defaults to False; lm_head has a bias"),
    _correct("mpt", "mpt"),
    _correct("llama", "llama"),
    _correct("mistral", "mistral"),
    _correct("qwen2", "qwen2"),
    _correct("qwen3", "qwen3", "q/k norms"),
    _correct("phi", "phi", "lm_head has a bias; tie defaults to False"),
    _correct("phi3", "phi3"),
    _correct("stablelm", "stablelm"),
    _correct("starcoder2", "starcoder2"),
    _correct("olmo", "olmo"),
    _correct("olmo2", "olmo2"),
    _correct("persimmon", "persimmon"),
    _correct("nemotron", "nemotron"),
    _correct("cohere", "cohere", "logit_scale multiplies the logits"),
    _correct("cohere2", "cohere2", "logit_scale; sliding window layers"),
    _correct("granite", "granite", "embedding_multiplier and logits_scaling"),
    _correct("glm", "glm"),
    _correct("helium", "helium"),
    _correct("gemma", "gemma", "lookup output scaled by sqrt(d)"),
    _correct("gemma2", "gemma2", "scaled lookup; logit softcapping"),
    _correct("gemma3-text", "gemma3", "scaled embedding module (Gemma3TextScaledWordEmbedding)"),
    _correct("gemma3-composite", "gemma3_composite",
             "Gemma3ForConditionalGeneration: the pad token named in config.text_config only"),
    _correct("fuyu", "fuyu_composite",
             "FuyuForCausalLM: the pad token named in config.text_config only"),
    _correct("prophetnet", "prophetnet",
             "ProphetNetForCausalLM: positions from padding_idx + 1, its predicting stream one "
             "further, so the longest sequence is a position short of RoBERTa's rule"),
    _correct("minicpm5-moe", "minicpm5_moe",
             "MoE experts, float32 only (no float64 grouped matmul): the forward check's "
             "larger steps switch experts, and a direction across a switch is left out"),
    _correct("mixtral", "mixtral", "MoE experts"),
    _correct("qwen2-moe", "qwen2_moe", "MoE experts plus shared expert"),
    _correct("phimoe", "phimoe", "sparsemixer samples its experts in train(): micro-batches "
             "draw other numbers than one batch (that check is n/a, not a failure)"),
    _correct("olmoe", "olmoe", "MoE experts"),
    _correct("qwen3-moe", "qwen3_moe", "MoE experts"),
    _correct("granitemoe", "granitemoe", "MoE experts; logit and embedding multipliers"),
    _correct("gpt-oss", "gpt_oss", "MoE experts; attention sinks"),
    _correct("deepseek-v3", "deepseek_v3", "MLA attention; MoE after the first layer"),
    _correct("gpt-bigcode", "gpt_bigcode", "multi-query attention; tied by default"),
    _correct("lfm2", "lfm2", "short-convolution and attention layers"),
    _correct("falcon-h1", "falcon_h1", "Mamba-2 and attention in parallel; embedding_multiplier "
             "2.5, lm_head_multiplier 0.75"),
    _correct("hyperclovax", "hyperclovax", "embedding_multiplier 2 and logits_scaling 0.5"),
    _correct("nanochat", "nanochat", "final logit soft-capping at 15"),
    _correct("vaultgemma", "vaultgemma", "scaled lookup; attention and final logit soft-capping"),
    _correct("llama4-text", "llama4_text", "chunked attention; MoE in every layer"),
    _correct("glm4-moe", "glm4_moe", "routed and shared experts after the first layer"),
    _correct("bitnet", "bitnet", "BitNet's quantised linear layers"),
    _correct("diffllama", "diffllama", "differential attention"),
    _correct("mamba", "mamba", "head returns .float() logits"),
    _correct("mamba2", "mamba2", "head returns .float() logits"),
    _correct("falcon-mamba", "falcon_mamba", "head returns .float() logits"),
    _correct("rwkv", "rwkv", "head is head; tie defaults to False"),
    _correct("bart", "bart", "shared/encoder/decoder/lm_head: one Parameter, three lookups",
             encoder_decoder=True),
    _correct("mbart", "mbart", encoder_decoder=True),
    _correct("marian", "marian", "scale_embedding; pad/decoder start = V-1",
             encoder_decoder=True),
    _correct("pegasus", "pegasus", "scale_embedding; sinusoidal positions",
             encoder_decoder=True),
    _correct("t5", "t5", "decoder output scaled by d_model**-0.5 before the tied head",
             encoder_decoder=True),
    _correct("bert-mlm", "bert_mlm", "MLM head: transform + LayerNorm + decoder with bias",
             masked_lm=True),
    _correct("roberta-mlm", "roberta_mlm", "MLM head; position ids from padding_idx=1",
             masked_lm=True),
    _correct("led", "led", "LEDModelTester's config: Longformer attention in the encoder",
             encoder_decoder=True),
    _correct("led-padded", "led_padded", "13 positions, padded to 16 by its attention: the "
             "float64 backward is NaN there, the float32 one it trains in is not",
             encoder_decoder=True),
    _correct("longformer-mlm", "longformer_mlm", "LongformerModelTester's config; MLM head",
             masked_lm=True),
    _correct("longformer-mlm-padded", "longformer_mlm_padded", "13 positions, padded to 16 "
             "by its attention: the float64 backward is NaN there", masked_lm=True),
    _untied("llama-untied", "llama_untied"),
    _untied("mistral-untied", "mistral_untied"),
    _untied("qwen2-untied", "qwen2_untied"),
    _untied("gpt-neox-untied", "gpt_neox_untied"),
    _untied("phi-untied", "phi_untied"),
    _untied("bert-mlm-untied", "bert_mlm_untied", masked_lm=True),
    _correct("scratch-mingpt-lambda", "mingpt_lambda",
             "minGPT Block.mlpf: a lambda attribute closing over the original module"),
    _correct("scratch-llama-fp32", "scratch_llama_fp32",
             "LLMs-from-scratch Llama 3: dtype=cfg['dtype'] (float32), head input cast to it"),
    _correct("scratch-llama-bf16", "scratch_llama_bf16",
             "LLMs-from-scratch Llama 3 with cfg['dtype'] = bfloat16, cast to it in forward "
             "(it cannot run wider): its rows' bfloat16 bound exceeds a dropped path, and the "
             "training steps, judged over every entry at once, have the power and agree"),
    _correct("scratch-mamba-fp32", "mamba_style_fp32",
             "Mamba-style head: .float() logits from a float32 body"),
    _correct("scratch-mamba-bf16", "mamba_style_bf16",
             "Mamba-style head: .float() logits from a bfloat16 body (judged as the Llama "
             "above)"),
    _correct("scratch-scaled-embedding", "scaled_embedding_subclass",
             "nn.Embedding subclass returning super().forward(ids) * sqrt(d)"),
    _correct("scratch-torchtune-tied-linear", "torchtune_tied_linear",
             "torchtune TiedLinear (a plain object): the head's weight has no second name"),
    _correct("scratch-torchtune-tied-linear-module", "torchtune_tied_linear_module",
             "TiedLinear as an nn.Module: F.linear(x, self.tied_module.weight)"),
    _correct("scratch-custom-function-lookup", "custom_function_lookup",
             "autograd.Function lookup whose backward uses index_add_"),
    _correct("scratch-inplace-scaled", "inplace_scaled_lookup",
             "CTRL-like x = self.w(ids); x *= sqrt(d)"),
    _correct("scratch-keyword-only-targets", "keyword_only_targets",
             "forward(self, idx, *, targets=None) -> (logits, loss)"),
    _correct("scratch-return-embeddings", "return_embeddings_flag",
             "forward(self, x, return_embeddings=False, mask=None) -> logits"),
    *(_broken(arch, bug, encoder_decoder=arch in ("bart", "t5"))
      for arch in ("gpt2", "llama", "gemma", "bart", "t5", "opt", "falcon_h1", "hyperclovax")
      for bug in BUGS),
)

#: The entries the default tier runs (the rest are marked slow).
FAST = ("gpt2", "llama", "bart", "llama-untied", "gpt2-copy-tie", "phimoe", "gemma3-composite")
