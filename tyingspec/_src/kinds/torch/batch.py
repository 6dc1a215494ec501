"""The batch a torch case trains on: tokens, targets with ignored positions, an attention mask.

Built in the worker from the case's tokens and targets and its setting (see
:mod:`kinds.torch.setting`): ``B`` sequences of ``T`` positions, some right-padded with the
model's pad token (its targets the ignore index the model's loss takes, its mask 0 there).
A padding row (``nn.Embedding(padding_idx=p)``) that nothing names a real token is never
drawn as one: a drawn ``p`` becomes another token, and ``p`` only ever pads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tyingspec._src.core.adapters import model_batch
from tyingspec._src.kinds.torch.setting import Setting

#: transformers' and torch's ignored target.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TorchBatch:
    """One batch as the model is handed it.  ``mask``: the attention mask, None when the case
    passes none (or the forward takes none); ``ignore_index``: what an ignored target holds."""

    tokens: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T] int64, ``ignore_index`` where ignored
    mask: torch.Tensor | None = None  # [B, T] int64, 1 where a position is real
    ignore_index: int = IGNORE_INDEX
    # [B, T] bool, False at padded positions (whether or not the forward takes a mask)
    real: torch.Tensor | None = None

    @property
    def sequences(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, start: int, stop: int) -> TorchBatch:
        """Sequences ``start:stop`` (a micro-batch)."""
        return replace(self, tokens=self.tokens[start:stop], targets=self.targets[start:stop],
                       mask=None if self.mask is None else self.mask[start:stop],
                       real=None if self.real is None else self.real[start:stop])

    def split(self, k: int) -> list[TorchBatch]:
        """``k`` micro-batches of (nearly) equal sequences, in order."""
        bounds = np.linspace(0, self.sequences, k + 1).round().astype(int)
        return [self.rows(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def flipped(self) -> TorchBatch:
        """The same positions in reverse order (another batch of the same composition)."""
        return replace(self, tokens=self.tokens.flip(-1), targets=self.targets.flip(-1),
                       mask=None if self.mask is None else self.mask.flip(-1),
                       real=None if self.real is None else self.real.flip(-1))

    def to(self, device: torch.device) -> TorchBatch:
        """This batch on ``device`` (itself where it is there already): the batch is built on
        the CPU and handed to a model where the model is (``--device``)."""
        if self.tokens.device == device:
            return self
        return replace(self, tokens=self.tokens.to(device), targets=self.targets.to(device),
                       mask=None if self.mask is None else self.mask.to(device),
                       real=None if self.real is None else self.real.to(device))

    def real_tokens(self) -> set[int]:
        """The ids the batch reads as real tokens (its padded positions left out)."""
        t = self.tokens if self.real is None else self.tokens[self.real]
        return {int(v) for v in t.reshape(-1).tolist()}

    def ignored(self) -> int:
        return int((self.targets == self.ignore_index).sum())

    def describe(self) -> str:
        B, T = (int(n) for n in self.tokens.shape)
        text = f"{B} x {T} tokens"
        if self.ignored():
            text += f", {self.ignored()} targets ignored ({self.ignore_index})"
        if self.mask is not None:
            text += f", attention_mask ({int((self.mask == 0).sum())} masked)"
        return text


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (its first one's device; the CPU for none)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def make_batch(spec: str, tokens: np.ndarray, targets: np.ndarray, setting: Setting, *,
               vocab: int, sequences: int, pad_token: int | None, padding_idx: int | None,
               ignore_index: int | None, takes_mask: bool, seed: int) -> TorchBatch:
    """The case's batch for a model of ``vocab`` tokens: ``sequences`` rows; with
    ``setting.pad``, some rows right-padded (where the model's loss takes an ``ignore_index``);
    with ``setting.mask`` and a forward that takes one, an attention mask."""
    t, y = model_batch(spec, {"tokens": tokens, "targets": targets}, sequences, vocab)
    if padding_idx is not None and padding_idx != pad_token and vocab > 1:
        # the padding row only pads: a drawn p reads as a real token the model declares it not
        # to be (padding_idx skips its input path), a finding the batch would have made up
        t[t == padding_idx] = (padding_idx + 1) % vocab
    pad = padding_idx if pad_token is None else pad_token
    mask = np.ones_like(t)
    if setting.pad and ignore_index is not None and t.shape[1] > 2:
        rng = np.random.default_rng([seed, 0x9ad])
        B, T = t.shape
        # every other sequence from the second on ends early, at least 2 real positions
        for i in range(1, B, 2):
            length = int(rng.integers(2, T))
            mask[i, length:] = 0
            y[i, length:] = ignore_index
            if pad is not None:
                t[i, length:] = pad
        if B == 1:
            length = int(rng.integers(2, T))
            mask[0, length:] = 0
            y[0, length:] = ignore_index
    given_mask = torch.from_numpy(mask) if (setting.mask or not mask.all()) and takes_mask \
        else None
    return TorchBatch(torch.from_numpy(t), torch.from_numpy(y), given_mask,
                      IGNORE_INDEX if ignore_index is None else ignore_index,
                      torch.from_numpy(mask.astype(bool)))
