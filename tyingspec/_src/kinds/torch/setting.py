"""A torch case's training configuration: its sequences, padding, loss path, micro-batches,
optimizer steps, dropout, autocast and compile.

A check that runs one small setting of its own passes every bug just past it: a lookup right
for the first 128 positions only, one that loses repeated tokens past 256 tokens per batch, a
bug that starts after the fifth forward, a path taken only when an attention mask is passed,
a loss that counts padded positions, a dropout that forgets its ``1/(1-p)``.  So every torch
case carries a setting, drawn from its seed and printed with it (a replay line rebuilds it):

* ``B`` sequences of ``T`` positions: ``T`` up to the model's whole context (``full``) or a part
  of it drawn from the seed, ``B`` up to what makes a batch of a thousand tokens or more (both
  within the check's budget, :func:`fitted_shape`);
* ``pad``: sequences right-padded to ``T`` with the model's pad token, their targets the ignore
  index (-100, or the one the model's loss takes) and, where the forward takes one, an
  ``attention_mask`` with zeros there; ``mask``: an ``attention_mask`` is passed at all;
* ``loss``: which of the model's loss paths this case trains through (``labels=``, its
  ``targets`` argument, or its logits with tyingspec's cross-entropy), cycling over those it has;
* ``micro``: the micro-batches the accumulation check splits the batch into; ``steps``: the
  optimizer steps of the training-loop check, each one's gradient judged;
* ``dropout``: the model's configured dropout kept (its masks drawn from a seeded generator, so
  every pass of one check draws the same ones) or set to 0;
* ``autocast`` and ``compile``: set for every case by ``--autocast`` and ``--compile`` (or by
  the ``TorchTarget``), the same judgement on those paths; ``device``: where the models and
  their batches live (``--device``, or the ``TorchTarget``'s), judged on the CPU.

Pure Python: the main process shapes the cases from what the worker said of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.cases import Case, at_model_setting, standard_cases

#: The settings a command line sets for every case (``--autocast``, ``--compile``,
#: ``--device``).
FLAGS = ("autocast", "compile", "device")
#: Where ``--device`` runs the models (a ``TorchTarget`` names any device torch knows).
DEVICES = ("cpu", "cuda")
AUTOCAST_DTYPES = ("bfloat16", "float16")
#: torch.compile backends a user names; "inductor" is torch's default (it compiles C++ on a
#: CPU, tens of seconds a graph), "aot_eager" traces forward and backward the same way and
#: runs them eagerly (what a test that only needs the traced path uses).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

#: A batch the check aims at: at least this many tokens (more sequences where the context is
#: short), so that a bug past a few hundred tokens per batch is inside it.
MIN_TOKENS = 1024
#: The most sequences a batch holds.
MAX_SEQUENCES = 16


@dataclass(frozen=True)
class Setting:
    """One case's configuration (see the module docstring).  ``B`` 0 and ``T`` 0 mean "the
    largest the model's shape allows"; a shaped case (:func:`at_model_shape`) spells both."""

    B: int = 0
    T: int = 0
    pad: bool = False
    mask: bool = False
    loss: int = 0
    micro: int = 2
    steps: int = 4
    dropout: bool = True
    autocast: str = ""
    compile: str = ""
    device: str = ""

    def text(self) -> str:
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                value = int(value)
            if value != "":
                out.append(f"{f.name}={value}")
        return ",".join(out)


def parse(text: str) -> Setting:
    """A setting from its text (``key=value,...``); unknown keys and bad values raise
    ValueError naming them."""
    given: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(Setting)}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in types:
            raise ValueError(f"unknown torch setting {key!r} in {text!r}; known: "
                             + ", ".join(types))
        kind = types[key]
        try:
            given[key] = value if kind == "str" else \
                bool(int(value)) if kind == "bool" else int(value)
        except ValueError:
            raise ValueError(f"torch setting {key}={value!r}: expected {kind}") from None
    setting = Setting(**given)
    if setting.autocast and setting.autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast={setting.autocast!r}: expected one of "
                         + ", ".join(AUTOCAST_DTYPES))
    if setting.compile and setting.compile not in COMPILE_BACKENDS:
        raise ValueError(f"compile={setting.compile!r}: expected one of "
                         + ", ".join(COMPILE_BACKENDS))
    return setting


def with_flags(case: Case, **flags: str) -> Case:
    """``case`` with the command line's settings (``autocast``, ``compile``) set."""
    setting = parse(case.setting)
    for key, value in flags.items():
        if value:
            setting = replace(setting, **{key: value})  # type: ignore[arg-type]
    return case if setting == parse(case.setting) else replace(case, setting=setting.text())


def flags_of(case: Case) -> dict[str, str]:
    """The command-line settings a case carries (for its replay line)."""
    setting = parse(case.setting)
    return {k: str(getattr(setting, k)) for k in FLAGS if getattr(setting, k)}


#: The torch kind's cases: the standard cases that do not set the probe model's own settings
#: or need a shape of their own, each with what it covers of the configuration.  Between them:
#: the largest batch and the whole context, a part of it, padding with and without a mask, a
#: case with no mask, every loss path the model has (``loss`` cycles over them), and one case
#: with dropout off.
_PLANS: dict[str, dict[str, Any]] = {
    "absent-tokens": dict(T=0, pad=False, mask=False, loss=0, dropout=True),
    "repeated-tokens": dict(T=0, pad=True, mask=True, loss=0, dropout=True),
    "one-token-repeated": dict(B=2, T=-1, pad=False, mask=True, loss=2, dropout=True),
    "token-zero": dict(T=0, pad=True, mask=True, loss=1, dropout=False),
}
NAMES = tuple(_PLANS)
_STANDARD = frozenset(c.name for c in standard_cases(0))


def drawn(case: Case) -> Case:
    """``case`` with its setting drawn from its seed (its micro-batches and steps) and its
    plan (``T=-1``: a part of the context, drawn once the context is known)."""
    rng = np.random.default_rng([case.seed, 0x7e])
    plan = _PLANS.get(case.name, {})
    setting = Setting(micro=int(rng.integers(2, 5)), steps=int(rng.integers(4, 13)), **plan)
    return replace(case, setting=setting.text())


def fitted_shape(context: int, budget_tokens: int, sequences: int | None
                 ) -> tuple[int, int]:
    """``(B, T)``, the largest batch a check runs: ``T`` the model's context, ``B`` enough
    sequences for :data:`MIN_TOKENS` tokens (at most :data:`MAX_SEQUENCES`, at least 2), both
    cut to ``budget_tokens`` tokens, ``T`` before ``B`` keeps at least 2 sequences.
    ``sequences``: the target's own batch size, kept."""
    T = max(2, min(context, budget_tokens // 2))
    B = sequences or max(2, min(MAX_SEQUENCES, -(-MIN_TOKENS // T)))
    B = max(1, min(B, budget_tokens // T)) if sequences is None else B
    return max(1, B), T


def at_model_shape(case: Case, V: int, d: int, B: int, T: int) -> Case:
    """``case`` at a model of vocabulary ``V`` and width ``d`` whose largest batch is ``B`` x
    ``T``: its setting spelled out, its N the batch's, its composition one the batch holds (a
    batch larger than the vocabulary cannot be of distinct tokens: half the vocabulary then,
    the other half absent, and a quarter of those present read once, so that rows of
    repeated tokens and rows of every present token are told apart)."""
    setting = parse(case.setting)
    rng = np.random.default_rng([case.seed, 0x71])
    t = T if setting.T == 0 else max(2, min(T, setting.T)) if setting.T > 0 else \
        int(rng.integers(2, max(3, T // 2 + 1)))
    b = B if setting.B == 0 else max(1, min(B, setting.B))
    setting = replace(setting, B=b, T=t, micro=max(1, min(setting.micro, b)))
    return at_model_setting(case, V, d, b * t, setting.text())


def torch_cases(seed: int) -> list[Case]:
    """The torch kind's cases (:data:`NAMES`), each with its setting drawn."""
    return [drawn(c) for c in standard_cases(seed) if c.name in _PLANS]


def shape_cases(spec: str, described: dict[str, Any], cases: list[Case]
                ) -> tuple[list[Case], list[str]]:
    """The cases at the model's shape (its vocabulary, width and largest batch, as the worker
    fitted it): each case's setting spelled out.  ``--shape`` asks for ``N`` positions: the
    batch's sequences, each ``N / B`` long (a sequence past the model's context is its own
    error, reported as such); an explicit batch keeps its tokens."""
    tie = described["tie"]
    V, d = int(tie["vocab"]), int(tie["width"])
    B, T = int(tie["batch_size"]), int(tie["seq_len"])
    out: list[Case] = []
    # the probe model's own settings and shapes (a model that brings its own has neither),
    # unless a case is asked for by itself (a property's)
    left_out = [c.name for c in cases if c.tokens is None and not c.setting
                and c.name not in _PLANS and c.name in _STANDARD] if len(cases) > 1 else []
    for case in cases:
        if case.name in left_out:
            continue
        if not case.setting:
            case = drawn(case)
        if case.tokens is not None:
            n = len(case.tokens)
            b = B if n % B == 0 else 1
            setting = replace(parse(case.setting), B=b, T=n // b)
            out.append(replace(case, V=V, d=d, N=n, probe=False,
                               setting=replace(setting, micro=min(setting.micro, b)).text()))
        elif case.given_shape:
            # the target's own batch size where it fixes one, else two sequences (one for an
            # odd N): the positions are what --shape asks for
            b = B if described.get("sequences_fixed") else 2 - case.N % 2
            if (case.V, case.d) != (V, d) or case.N % b:
                raise AdapterError(spec, "--shape does not fit the model", key="--shape",
                                   expected=f"V={V} d={d} (the model's) and N a multiple of "
                                            f"its batch size {b}",
                                   got=f"V={case.V} d={case.d} N={case.N}")
            out.append(at_model_shape(replace(case, setting=replace(
                parse(case.setting), B=b, T=case.N // b).text()), V, d, b, case.N // b))
        else:
            out.append(at_model_shape(case, V, d, B, T))
    notes = [f"the model's shape: V={V} d={d}; {described.get('shape_note', '')}".rstrip("; ")]
    if left_out:
        notes.append(f"left out at that shape: {', '.join(left_out)}")
    return out, notes
