"""A jax case's setting: the batch it runs (``B`` sequences of ``T`` positions) and the dtype
its table runs in, drawn from the case's seed within what the model takes.

A check that runs one small batch of its own passes every bug just past it: a ``custom_vjp``
lookup that overwrites repeated rows only past the 16th token passes a 2 x 8 batch, and one
that halves the table's gradient only for a bfloat16 table passes a float32 one.  So every
jax case carries a setting, drawn from its seed and printed with it (a replay of the case
draws it again):

* ``B`` x ``T``: the largest batch the model takes within the check's budget (worked out in
  the worker, :mod:`kinds.jax.shape`: its whole context where it declares one, else
  sequences of :data:`kinds.jax.shape.DRAWN_CONTEXT` positions), or a part of it drawn from
  the seed, never fewer than :data:`MIN_DRAWN_TOKENS` tokens when the largest holds them;
* ``table``: the dtype the table runs in for this case: its own, or (``one-token-repeated``)
  the lower one the model runs it in (the 16-bit dtype it casts the table to at a use, or
  bfloat16 for a table held in float32 or float64, the dtype mixed-precision training runs it
  in), judged at that dtype's bound.

Pure Python: the main process shapes the cases from what the worker said of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.cases import Case, at_model_setting, standard_cases

#: A drawn batch holds at least this many tokens (when the largest batch does): a bug past
#: the first few hundred tokens is inside every case.
MIN_DRAWN_TOKENS = 256


@dataclass(frozen=True)
class Setting:
    """One case's batch and table dtype; 0 and "" mean "not set" (the model's largest batch,
    the table's own dtype)."""

    B: int = 0
    T: int = 0
    table: str = ""

    def text(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if getattr(self, f.name) not in (0, "")]
        return ",".join(parts)


def parse(text: str) -> Setting:
    """A setting from its text (``B=2,T=512,table=bfloat16``); an unknown key or a bad value
    raises ValueError naming it."""
    given: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key == "table":
            given[key] = value
        elif key in ("B", "T"):
            try:
                given[key] = int(value)
            except ValueError:
                raise ValueError(f"jax setting {key}={value!r}: expected an integer") from None
        else:
            raise ValueError(f"unknown jax setting {key!r} in {text!r}; known: B, T, table")
    return Setting(**given)


#: The jax kind's cases, each with what it covers: the largest batch (``whole``) or a part
#: drawn from the seed, in the table's own dtype or the lower one (``low``).  The lower dtype
#: goes to one case, whose one repeated token leaves every other row absent: in 16 bits the
#: rows check rarely has power and the forward check judges, and it sees a path's error best
#: on the rows holding that path alone.  One case of four keeps the run's label the own
#: dtype's (the forward alone cannot tell some labels apart where every present token
#: repeats: a dropped input path reads as repeats not accumulated).
_PLANS: dict[str, dict[str, bool]] = {
    "absent-tokens": dict(whole=True, low=False),
    "repeated-tokens": dict(whole=False, low=False),
    "one-token-repeated": dict(whole=False, low=True),
    "token-zero": dict(whole=True, low=False),
}
NAMES = tuple(_PLANS)


def jax_cases(seed: int) -> list[Case]:
    """The jax kind's cases (:data:`NAMES`); their settings are drawn at the model's shape."""
    return [c for c in standard_cases(seed) if c.name in _PLANS]


def drawn(case: Case, B: int, T: int, low: str | None) -> Setting:
    """``case``'s setting within a largest batch of ``B`` x ``T``: its plan's, or for a case
    of no plan (a property's) one drawn from its seed; ``low``: the lower dtype the model's
    table runs in (None: none to run)."""
    rng = np.random.default_rng([case.seed, 0x1a5])
    # a property's case keeps the table's own dtype: the examples of one property, and the
    # candidates shrinking tries, are judged alike
    plan = _PLANS.get(case.name) or dict(whole=bool(rng.integers(0, 2)), low=False)
    table = low if plan["low"] and low else ""
    if plan["whole"]:
        return Setting(B, T, table)
    t = int(rng.integers(max(2, -(-T // 4)), T + 1))
    b = int(rng.integers(1, B + 1))
    # at least MIN_DRAWN_TOKENS tokens (or all the largest batch holds)
    b = max(b, min(B, -(-min(MIN_DRAWN_TOKENS, B * T) // t)))
    return Setting(b, t, table)


def _given_batch(spec: str, N: int, B: int, T: int, fixed: bool) -> tuple[int, int]:
    """``B`` x ``T`` for ``N`` given positions (``--shape``, or a replay's tokens): the fewest
    sequences that fit the model's longest (``T``), or its own batch size when it fixes one."""
    if fixed:
        if N % B:
            raise AdapterError(spec, "--shape does not fit the model", key="--shape",
                               expected=f"N a multiple of its batch size {B}", got=f"N={N}")
        return B, N // B
    b = next((b for b in range(1, N + 1) if N % b == 0 and N // b <= T), N)
    return b, N // b


def shape_cases(spec: str, described: dict[str, Any], cases: list[Case]
                ) -> tuple[list[Case], list[str]]:
    """The cases at the model's shape (its vocabulary, width and largest batch, as the worker
    fitted it), each case's setting spelled out, and the report's notes: where the sizes come
    from and which sizes and dtypes the cases cover."""
    tie = described["tie"]
    V, d = int(tie["vocab"]), int(tie["width"])
    B, T = int(tie["batch_size"]), int(tie["seq_len"])
    low = described.get("low_dtype")
    fixed = bool(described.get("fixed_batch"))
    left_out = [c.name for c in cases if c.tokens is None and c.name not in _PLANS
                and c.name in {s.name for s in standard_cases(0)}] if len(cases) > 1 else []
    out: list[Case] = []
    for case in cases:
        if case.name in left_out:
            continue
        setting = drawn(case, B, T, low)
        if fixed:  # the target's seq_len (and batch_size): every case runs that batch
            setting = replace(setting, B=B, T=T)
        if case.tokens is not None or case.given_shape:
            n = len(case.tokens) if case.tokens is not None else case.N
            if case.given_shape and (case.V, case.d) != (V, d):
                raise AdapterError(spec, "--shape does not fit the model", key="--shape",
                                   expected=f"V={V} d={d} (the model's)",
                                   got=f"V={case.V} d={case.d} N={case.N}")
            b = setting.B if case.tokens is not None and n % setting.B == 0 else \
                _given_batch(spec, n, B, T, fixed)[0]
            setting = replace(setting, B=b, T=n // b)
        out.append(_at(case, V, d, setting))
    sizes = ", ".join(f"{c.name} {parse(c.setting).B}x{parse(c.setting).T}"
                      + (f" {parse(c.setting).table}" if parse(c.setting).table else "")
                      for c in out)
    notes = [f"the model's shape: V={V} d={d}; {described.get('shape_note', '')}".rstrip("; "),
             f"sizes covered: {sizes}"]
    if low:
        notes.append(f"the table runs in {tie['dtype']} and in {low}: cases marked {low} run "
                     f"it in {low}, judged at {low}'s bound (under --precision every case runs "
                     "in that one)")
    if left_out:
        notes.append(f"left out at that shape: {', '.join(left_out)}")
    return out, notes


def _at(case: Case, V: int, d: int, setting: Setting) -> Case:
    """``case`` at the model's vocabulary and width and its setting's batch: its composition
    one the batch holds (a batch larger than the vocabulary cannot be of distinct tokens:
    half the vocabulary then, the other half absent, and a quarter of those present read once,
    so that the rows of repeated tokens and those of every present token are told apart)."""
    return at_model_setting(case, V, d, setting.B * setting.T, setting.text())
