"""Write a checkpoint whose tie drifted, for ``tyingspec ckpt`` to find and repair.

    python examples/ckpt/make_drifted.py drifted.safetensors

A tiny tied model (nanoGPT's key names) whose head was saved as its own copy of the embedding
plus a little noise: what a tie that was a copy leaves after training.  Next to it,
``examples/ckpt/config.json`` says ``tie_word_embeddings: true``, so a loader would keep one
matrix and discard the other.  Needs ``pip install 'tyingspec[torch]'``.
"""

import sys

import torch
from safetensors.torch import save_file
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(64, 16)})
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # the tie


if __name__ == "__main__":
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Tiny().state_dict().items()}
    state["lm_head.weight"] += 0.01 * torch.randn_like(state["lm_head.weight"])
    save_file(state, sys.argv[1])
