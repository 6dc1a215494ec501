"""A transformers model under ``--kind torch``, built from a config (nothing is downloaded).

    tyingspec check examples.transformers_gpt2.hf:make_model --kind torch

Needs ``pip install 'tyingspec[transformers]'``.  The tie is read from the instance
(``get_input_embeddings().weight is get_output_embeddings().weight``) and the loss is the
model's own (``labels=``, shifted by the model for a causal LM).
"""

from transformers import GPT2Config, GPT2LMHeadModel


def make_model():
    # bos/eos given: GPT2Config's defaults (50256) lie outside a 64-token vocabulary
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))
