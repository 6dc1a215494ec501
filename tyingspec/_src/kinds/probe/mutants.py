"""The mutant zoo: deliberately broken tied gradients, each imitating a bug people shipped, and
correct implementations written in several styles.

Every mutant names the invariant it breaks (catalogue names: SUM, ROWS, DUP, PAD, ID, FRESH,
SCALE, PURE — see the README) and ``expected``: the diagnosis label the check reaches on the call
that reveals it.  For most mutants that is any call on a batch with power; the stateful ones
(``copy-tie``, ``grad-not-zeroed``) reveal themselves on their *second* call after
:func:`reset_state`, and ``sorts-tokens-in-place`` / ``db-sum-not-mean`` have a right dE, so their
label comes from the mutation report and the other-output checks.  ``tyingspec mutants`` runs
every property against every mutant (the kill matrix); ``properties/_signatures.py`` asserts each
mutant's fingerprint.

Stateful mutants keep their state in this module and treat calls with the same ``W`` and ``b``
(model form) or the same shape (kernel form) as calls on one model instance; call
:func:`reset_state` between independent runs so a kill matrix does not depend on run order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from tyingspec._src.core.paths import Array, IntArray, flatten_batch, forward_parts, scatter_rows
from tyingspec._src.kinds.probe.registry import (
    Combiner,
    Implementation,
    ModelFn,
    model_from_combiner,
    register,
)

MUTANT, STYLE, STATEFUL = "mutant", "style", "stateful"

#: The logit scale a fused loss forgot (unsloth-zoo PR #930: 0.0625, so the gradient was 16x).
LOGIT_SCALE = 0.0625


def _both(name: str, description: str, breaks: str | None, expected: str, combine: Combiner,
          *tags: str) -> None:
    register(Implementation(name, description, breaks, expected,
                            model=model_from_combiner(combine), kernel=combine, tags=tags))


def _model_only(name: str, description: str, breaks: str | None, expected: str, model: ModelFn,
                *tags: str) -> None:
    register(Implementation(name, description, breaks, expected, model=model, tags=tags))


def _result(p: Any, dE: Array, db: Array | None = None) -> dict[str, Any]:
    return {"loss": p.loss, "dE": dE, "dW": p.dW, "db": p.db if db is None else db}


# --- SUM / ROWS: a path lost, overwritten, averaged, doubled ---------------------------------

def _overwritten(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    dE = g.T @ h
    dE[tokens] = scatter_rows(tokens, dx, V)[tokens]  # `=` where `+=` was meant (TE #3437)
    return dE


def _averaged(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    return (scatter_rows(tokens, dx, V) + g.T @ h) / 2  # the two copies' gradients averaged


def _input_doubled(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    dE = g.T @ h
    for _ in range(2):  # the backward hook of the lookup registered twice
        dE += scatter_rows(tokens, dx, V)
    return dE


# --- DUP: repeated tokens lose occurrences -----------------------------------------------------

def _first_only(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    # index_put_(accumulate=False) on a backend where the first write wins
    first = np.unique(tokens, return_index=True)[1]
    return g.T @ h + scatter_rows(tokens[first], dx[first], V)


def _last_only(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    buf = np.zeros((V, dx.shape[1]), dtype=dx.dtype)
    for n in range(tokens.shape[0]):  # index_copy_: each occurrence overwrites the previous one
        buf[tokens[n]] = dx[n]
    return g.T @ h + buf


# --- SCALE: a stray factor on one path --------------------------------------------------------

def _logit_scale(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    # forward scaled the logits by LOGIT_SCALE; the fused backward of the head forgot it
    return scatter_rows(tokens, dx, V) + (g.T @ h) / g.dtype.type(LOGIT_SCALE)


def _input_summed(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    # the embedding backward used the sum over positions, the head the mean: x N on one path
    n = dx.dtype.type(tokens.shape[0])
    return scatter_rows(tokens, dx * n, V) + g.T @ h


def _s_in_missing(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
                  *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    t, y = flatten_batch(tokens, targets)
    p = forward_parts(E, E, W, b, t, y, res, s_in)
    # forward looked up s_in * E[t]; the backward scattered dL/dx, forgetting d(s_in E)/dE = s_in
    return _result(p, p.g.T @ p.h + scatter_rows(t, p.dx, E.shape[0]))


def _db_summed(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
               *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    t, y = flatten_batch(tokens, targets)
    p = forward_parts(E, E, W, b, t, y, res, s_in)
    db = None if p.db is None else p.db * p.db.dtype.type(t.shape[0])  # bias grad of a sum loss
    return _result(p, p.g.T @ p.h + scatter_rows(t, p.input_rows, E.shape[0]), db)


# --- the output path built from the wrong activations -----------------------------------------

def _output_from_x(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
                   *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    t, y = flatten_batch(tokens, targets)
    p = forward_parts(E, E, W, b, t, y, res, s_in)
    # the head's weight gradient saved the block's input x instead of its output h
    return _result(p, p.g.T @ p.x + scatter_rows(t, p.input_rows, E.shape[0]))


# --- PAD: a padding row that the model does not have ------------------------------------------

def _pad_masked(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    keep = tokens != 0  # padding_idx=0 left on for a vocabulary without padding
    return g.T @ h + scatter_rows(tokens[keep], dx[keep], V)


# --- PURE: writes into its inputs -------------------------------------------------------------

def _sort_in_place(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    order = np.argsort(tokens, kind="stable")
    tokens.sort(kind="stable")  # the bug: sorts the caller's array for a segmented reduction
    return g.T @ h + _segment_sums(tokens, dx[order], V)


def _segment_sums(sorted_tokens: IntArray, rows: Array, V: int) -> Array:
    out = np.zeros((V, rows.shape[1]), dtype=rows.dtype)
    if sorted_tokens.shape[0] == 0:
        return out
    starts = np.flatnonzero(np.r_[True, sorted_tokens[1:] != sorted_tokens[:-1]])
    out[sorted_tokens[starts]] = np.add.reduceat(rows, starts, axis=0)
    return out


# --- stateful: FRESH (a buffer never zeroed) and ID (a tie that is a copy) --------------------

_BUFFERS: dict[tuple[Any, ...], Array] = {}
_COPIES: dict[bytes, dict[str, Array]] = {}


def reset_state() -> None:
    """Forget every stateful mutant's state (gradient buffers, untied copies)."""
    _BUFFERS.clear()
    _COPIES.clear()


def _stale_kernel(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    # A workspace cached per shape and accumulated into, never zeroed between calls.
    buf = _BUFFERS.setdefault(("kernel", V, dx.shape[1], dx.dtype.str),
                              np.zeros((V, dx.shape[1]), dtype=dx.dtype))
    buf += g.T @ h + scatter_rows(tokens, dx, V)
    return buf.copy()


def _stale_model(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
                 *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    t, y = flatten_batch(tokens, targets)
    p = forward_parts(E, E, W, b, t, y, res, s_in)
    # one buffer per model instance (W and b identify it, as for copy-tie)
    buf = _BUFFERS.setdefault(("model", _model_key(W, b)) + E.shape + (E.dtype.str,),
                              np.zeros_like(E))
    buf += p.g.T @ p.h + scatter_rows(t, p.input_rows, E.shape[0])  # E.grad without zero_grad
    return _result(p, buf.copy())


def _model_key(W: Array, b: Array | None) -> bytes:
    h = hashlib.sha1(W.tobytes())
    h.update(b"none" if b is None else b.tobytes())
    return h.digest()


def _sgd_step(delta: Array, grad: Array) -> float | None:
    """The lr of ``delta = -lr * grad`` if ``delta`` is such a step (lr > 0), else None."""
    gg = float(np.vdot(grad, grad))
    if gg == 0.0 or not delta.any():
        return None
    lr = -float(np.vdot(delta, grad)) / gg
    resid = float(np.linalg.norm(delta + lr * grad))
    return lr if lr > 0 and resid <= 1e-3 * float(np.linalg.norm(delta)) else None


def _copy_tie(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
              *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    """A 'tie' made by copying E into a separate head matrix U at initialisation.

    The model instance is identified by (W, b).  When the E it is called with is the previous E
    moved by an SGD step along the gradient it returned, the caller's optimizer has stepped the
    lookup copy; the model steps its head copy with the same learning rate but with the head's
    own gradient only, as an optimizer holding two parameters does.  Any other E starts a fresh
    instance (U = E), so the first call on any batch is exactly right.
    """
    t, y = flatten_batch(tokens, targets)
    key = _model_key(W, b)
    state = _COPIES.get(key)
    U: Array | None = None
    if state is not None and state["E"].shape == E.shape:
        if np.array_equal(state["E"], E):
            U = state["U"]
        else:
            lr = _sgd_step(E.astype(np.float64) - state["E"], state["dE"])
            if lr is not None:
                U = (state["U"] - lr * state["dU"]).astype(E.dtype)
    if U is None:
        U = E.copy()
    p = forward_parts(E, U, W, b, t, y, res, s_in)
    dE_in = scatter_rows(t, p.input_rows, E.shape[0])
    dU = p.g.T @ p.h
    dE = dE_in + dU  # reported as "the" embedding gradient: right while U == E
    _COPIES[key] = {"E": E.astype(np.float64), "U": U, "dE": dE.astype(np.float64), "dU": dU}
    return _result(p, dE)


# --- correct styles ----------------------------------------------------------------------------

def _bincount(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    scattered = np.zeros((V, dx.shape[1]), dtype=dx.dtype)
    for j in range(dx.shape[1]):  # one weighted histogram per column of dx
        scattered[:, j] = np.bincount(tokens, weights=dx[:, j], minlength=V)
    return g.T @ h + scattered


def _one_hot(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    onehot: Array = (tokens[:, None] == np.arange(V)[None, :]).astype(dx.dtype)  # [N, V]
    return onehot.T @ dx + g.T @ h


def _sorted_segments(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    order = np.argsort(tokens, kind="stable")  # sorts a copy: the caller's tokens stay as given
    return g.T @ h + _segment_sums(tokens[order], dx[order], V)


def _f32_kernel(tokens: IntArray, dx: Array, h: Array, g: Array, V: int) -> Array:
    f = np.float32
    return g.astype(f).T @ h.astype(f) + scatter_rows(tokens, dx.astype(f), V)


def _f32_model(E: Array, W: Array, b: Array | None, tokens: Any, targets: Any,
               *, res: float = 1.0, s_in: float = 1.0) -> dict[str, Any]:
    f = np.float32
    t, y = flatten_batch(tokens, targets)
    E32 = E.astype(f)
    p = forward_parts(E32, E32, W.astype(f), None if b is None else b.astype(f), t, y, res, s_in)
    return _result(p, p.g.T @ p.h + scatter_rows(t, p.input_rows, E.shape[0]))


# --- registration ------------------------------------------------------------------------------

_both("output-path-overwritten",
      "`=` instead of `+=`: the input path overwrites the output path on rows of batch tokens "
      "(TransformerEngine #3437)", "SUM/ROWS", "output_path_overwritten", _overwritten, MUTANT)
_both("paths-averaged", "the two uses' gradients averaged instead of summed (x0.5 each)",
      "SUM/SCALE", "path_scaled", _averaged, MUTANT)
_both("input-path-doubled", "the lookup's backward hook registered twice: input path x2",
      "SCALE", "path_scaled", _input_doubled, MUTANT)
_both("duplicates-first-only",
      "index_put_(accumulate=False), first write wins: a repeated token keeps its first "
      "occurrence only", "DUP", "duplicates_not_accumulated", _first_only, MUTANT)
_both("duplicates-last-only",
      "index_copy_: a repeated token keeps its last occurrence only (pytorch #1528)",
      "DUP", "duplicates_not_accumulated", _last_only, MUTANT)
_both("logit-scale-dropped",
      f"fused loss forgot the logit scale {LOGIT_SCALE} in the head's backward: output path "
      f"x{1 / LOGIT_SCALE:g} (unsloth-zoo PR #930)", "SCALE", "path_scaled", _logit_scale, MUTANT)
_both("input-path-sum-not-mean",
      "the embedding backward reduced with the sum, the head with the mean: input path xN",
      "SCALE", "path_scaled", _input_summed, MUTANT)
_model_only("s-in-missing-in-backward",
            "s_in applied in the forward lookup but not in the backward scatter: input path "
            "x1/s_in", "SCALE", "path_scaled", _s_in_missing, MUTANT)
_model_only("output-path-from-x",
            "the head's gradient built from the block input x instead of its output h",
            "SUM", "output_path_wrong", _output_from_x, MUTANT)
_both("padding-row-masked",
      "padding_idx=0 left on although the vocabulary has no padding: token 0 never gets its "
      "input path (pytorch #26302 family)", "PAD", "input_path_wrong", _pad_masked, MUTANT)
_model_only("db-sum-not-mean", "the bias gradient of a sum loss next to a mean loss: db xN",
            "SCALE", "other_gradient_wrong", _db_summed, MUTANT)
_both("sorts-tokens-in-place",
      "sorts the caller's tokens in place for a segmented reduction; the gradient is right",
      "PURE", "inputs_mutated", _sort_in_place, MUTANT)
register(Implementation(
    "grad-not-zeroed",
    "gradient buffer cached per shape and accumulated into, never zeroed: the second call "
    "returns the sum of both", "FRESH", "gradient_not_zeroed", model=_stale_model,
    kernel=_stale_kernel,
    tags=(MUTANT, STATEFUL)))
_model_only("copy-tie",
            "the tie is a copy: head U = E at initialisation, each stepped with its own gradient, "
            "so they diverge after one optimizer step (LLMs-from-scratch #822, flax #1263)",
            "ID", "tie_is_a_copy", _copy_tie, MUTANT, STATEFUL)

_both("tied-bincount", "input path as np.bincount per column of dx", None, "correct",
      _bincount, STYLE)
_both("tied-one-hot", "input path as one-hot(tokens).T @ dx", None, "correct",
      _one_hot, STYLE)
_both("tied-sorted-segments",
      "input path as a segmented np.add.reduceat over tokens sorted in a copy",
      None, "correct", _sorted_segments, STYLE)
register(Implementation("tied-float32", "float32 end to end (judged at float32)", None,
                        "correct", model=_f32_model, kernel=_f32_kernel, tags=(STYLE,)))
