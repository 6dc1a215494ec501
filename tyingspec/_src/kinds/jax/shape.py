"""The largest batch a jax check runs, and the dtypes its table runs in.

Runs in the worker, when the target is described.  The batch is the model's whole context
where it declares one, within a budget:

* the context: an attribute the model or its config declares (:data:`CONTEXT_NAMES`: Flax
  lm1b's ``max_len``, nanoGPT's ``block_size``, ...), or the size of a position table found
  in the loss's jaxpr (a leaf other than the table read by a lookup whose indices count
  0, 1, ... along the sequence, ``pos(arange(T))``, or sliced from 0 to the sequence length,
  ``pe[:, :T]``); the shortest of them.  A model that declares none gets sequences of
  :data:`DRAWN_CONTEXT` positions;
* the budget: one forward and backward of at most :data:`PASS_FLOPS` floating-point
  operations (XLA's own count for the lowered loss: deterministic, so a replay draws the same
  sizes on any machine, and nothing is compiled to know it), and logits of at most
  :data:`MAX_LOGITS` entries; the sequence is halved while a pass costs more.

The table runs in its own dtype and, for some cases, in a lower one (see
:mod:`kinds.jax.setting`): a 16-bit dtype the model converts it to at a use, else bfloat16
for a table held in float32 or float64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from tyingspec._src.kinds.jax import split
from tyingspec._src.kinds.jax.discover import PLACEHOLDER, Form, Tie, placeholder

#: Attribute names under which a model (or its ``config``) declares its context length.
CONTEXT_NAMES = ("max_len", "max_length", "max_seq_len", "max_seq_length",
                 "max_sequence_length", "max_position_embeddings", "n_positions", "n_ctx",
                 "block_size", "context_length", "max_target_length")
#: Where a config hangs off a model.
_CONFIGS = ("config", "cfg", "conf", "hparams", "args")

#: The sequence a model that declares no context is checked at (cases draw shorter ones).
DRAWN_CONTEXT = 512
#: The largest batch: at least MIN_TOKENS tokens where the context is short (more sequences),
#: at most MAX_SEQUENCES sequences and MAX_TOKENS tokens.
MIN_TOKENS = 1024
MAX_SEQUENCES = 16
MAX_TOKENS = 4096
#: Floating-point operations one forward and backward may cost: a check makes a few hundred
#: passes (the forward check's directional differences are most of them).
PASS_FLOPS = 1e9
#: Logit entries a batch may hold (N x V): the check keeps g [N, V] in float64.
MAX_LOGITS = 2**25

#: 16-bit floats a table can run in, in the order preferred for the low-precision case.
LOW_DTYPES = ("bfloat16", "float16")


def _declared(obj: Any, where: str, depth: int, seen: set[int],
              found: list[tuple[int, str]]) -> None:
    if obj is None or id(obj) in seen or depth > 4 or isinstance(obj, (jax.Array, np.ndarray)):
        return
    seen.add(id(obj))
    for name in CONTEXT_NAMES:
        try:
            value = getattr(obj, name, None)
        except Exception:  # noqa: BLE001  (a property that raises declares nothing)
            value = None
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 1:
            found.append((int(value), f"{where}.{name}"))
    children: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children.update({f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)})
    elif hasattr(obj, "__dict__") and _is_module(obj):
        children.update(vars(obj))
    for name in _CONFIGS:
        if name not in children:
            try:
                children[name] = getattr(obj, name, None)
            except Exception:  # noqa: BLE001
                pass
    for name, child in children.items():
        if name.startswith("_") or not (_is_module(child) or name in _CONFIGS or
                                        dataclasses.is_dataclass(child)):
            continue
        _declared(child, f"{where}.{name}", depth + 1, seen, found)


def _is_module(obj: Any) -> bool:
    from flax import linen, nnx

    return isinstance(obj, (nnx.Module, linen.Module))


def _position_tables(tr: split.Traced, tie: Tie, T: int) -> list[tuple[int, str]]:
    """Position tables in the loss traced at sequences of ``T``: ``(rows, description)``."""
    skip = {tie.embedding, tie.head}
    out: list[tuple[int, str]] = []
    for i, x in enumerate(tr.leaves):
        shape = tuple(int(n) for n in np.shape(x))
        # a position table is added to the stream: its last axis is the width
        if tr.paths[i] in skip or len(shape) < 2 or shape[-1] != tie.width:
            continue
        use = split.survey(tr, i)
        if use.by_position and len(shape) == 2 and shape[0] >= T:
            out.append((shape[0], f"position table {tr.paths[i]} {list(shape)}"))
        for whole, starts, sizes in use.slices:
            for axis, (n, a, k) in enumerate(zip(whole, starts, sizes)):
                if a == 0 and k == T and n > T and axis < len(whole) - 1:
                    out.append((n, f"position table {tr.paths[i]} {list(shape)} (sliced to "
                                   "the sequence)"))
    return out


def context(form: Form, tie: Tie, tr: split.Traced, T: int) -> tuple[int | None, str]:
    """The model's context length and where it was read, or None (and why)."""
    found: list[tuple[int, str]] = []
    owner = form.model if form.model is not None else form.target
    _declared(owner, type(owner).__name__, 0, set(), found)
    found += _position_tables(tr, tie, T)
    if not found:
        return None, f"no context declared (no {'/'.join(CONTEXT_NAMES[:3])}/..., no position " \
                     "table)"
    n, where = min(found)
    return n, f"context {n} positions ({where})"


def _pass_flops(form: Form, B: int, T: int, V: int) -> float | None:
    """XLA's count of one forward and backward at ``B`` x ``T`` (lowered, not compiled)."""
    t, y = placeholder(B, T, V)
    cost = jax.jit(jax.value_and_grad(form.loss)).lower(form.params, t, y).cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = cost.get("flops") if isinstance(cost, dict) else None
    return float(flops) if flops is not None and flops >= 0 else None


def _sequences(T: int) -> int:
    return max(2, min(MAX_SEQUENCES, -(-MIN_TOKENS // T), MAX_TOKENS // T))


def fitted(form: Form, tie: Tie, tr: split.Traced) -> tuple[int, int, str]:
    """``(B, T, note)``: the largest batch a check runs (see the module docstring)."""
    target = form.target
    if target.seq_len:
        B = target.batch_size or 2
        return B, target.seq_len, f"{B} x {target.seq_len} tokens (the target's seq_len" \
            f"{', batch_size' if target.batch_size else ''})"
    # discovery traced the loss at the placeholder's sequence length: a position table is
    # sliced to it
    ctx, where = context(form, tie, tr, PLACEHOLDER[1])
    T = min(ctx or DRAWN_CONTEXT, MAX_TOKENS // 2)
    B = target.batch_size or _sequences(T)
    cut = []
    while B * T * tie.vocab > MAX_LOGITS and (B > 1 or T > 2):
        if B > 1:
            B = max(1, B // 2)
        else:
            T = max(2, T // 2)
        cut = [f"logits of at most {MAX_LOGITS} entries"]
    flops = None
    while True:
        try:
            flops = _pass_flops(form, B, T, tie.vocab)
        except Exception as exc:  # noqa: BLE001  (a length the model cannot take: shorter)
            if T <= 2:
                raise
            cut.append(f"the loss raised at T = {T} ({type(exc).__name__}: {str(exc)[:120]})")
            T = max(2, T // 2)
            continue
        if flops is None or flops <= PASS_FLOPS or T <= 2:
            break
        cut.append(f"a pass at T = {T} costs {flops:.3g} flops, over {PASS_FLOPS:.3g}")
        T = max(2, T // 2)
        B = target.batch_size or _sequences(T)
    note = f"{where}; batches up to {B} x {T} = {B * T} tokens"
    if flops is not None:
        note += f" ({flops:.3g} flops a forward and backward)"
    if cut:
        note += f"; cut by {cut[-1]} (JaxTarget(seq_len=...) checks longer sequences)"
    return B, T, note


def low_dtype(tie: Tie, tr: split.Traced) -> str | None:
    """The lower dtype the table runs in, besides its own: the 16-bit float the model
    converts it to at a use, else bfloat16 for a table held in float32 or float64; None for a
    table already held in a 16-bit float."""
    if tie.dtype in LOW_DTYPES:
        return None
    casts = split.survey(tr, tr.paths.index(tie.embedding)).casts
    for dtype in casts:
        if dtype in LOW_DTYPES:
            return dtype
    return "bfloat16"
