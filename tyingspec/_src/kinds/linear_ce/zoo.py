"""Built-in linear-cross-entropy targets for the linear-ce kind: correct and broken.

A fused linear-cross-entropy kernel (Liger's ``LigerFusedLinearCrossEntropyLoss``, Apple's
cut-cross-entropy) never materialises the ``N x V`` logits: it walks over the tokens in chunks,
builds one chunk's logits, turns them into that chunk's loss and gradient and accumulates
``dh``, ``dE`` and ``db``.  With a tied ``E`` the kernel's ``dE`` *is* the output path of the
tied gradient, so an error in it is an error in the embedding.

The contract every correct implementation computes, for ``h [N, d]``, ``E [V, d]``, integer
``targets [N]`` and an optional bias ``b [V]``::

    a    = s * (h @ E.T + b)                     logit_scale s (b left out when None)
    z    = c * tanh(a / c)  (or a when c None)   softcap c
    lse  = logsumexp_j z_ij                      (max-shifted: finite at |z| ~ 1e4 in float32)
    l_i  = lse_i - (1 - eps) z[i, y_i] - eps mean_j z_ij + lam lse_i**2
    t_i  = w[y_i] (1 without ce_weight) if y_i != ignore_index else 0

    mean: L = sum_i t_i l_i / sum_i t_i   (0, with every gradient 0, when all are ignored)
    sum:  L = sum_i t_i l_i
    none: L_i = t_i l_i, differentiated as sum_i go_i L_i for a grad_output go [N]

It comes in two forms.  The numpy *function* form::

    f(h, E, targets, b=None, *, grad_output=None, logit_scale=1.0, softcap=None,
      label_smoothing=0.0, lse_square_scale=0.0, ignore_index=-100, reduction="mean",
      ce_weight=None) -> {"loss": ..., "dh": ..., "dE": ..., "db": ...}

whose keyword parameters are the options it supports, computed in the dtype of ``h``/``E``.
The torch *class* form follows Liger's calling convention,
``cls(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, ce_weight,
logit_scale)`` then ``loss_fn(lin_weight, _input, target, bias=None)``, with the gradients
read through autograd.

Every implementation here chunks over ``N`` with :data:`CHUNK` = 7 rows, deliberately not a
power of two, so that the last chunk is usually partial, as it is in a real kernel.  The numpy
form walks blocks of :data:`BLOCK` = 1024 tokens (a real kernel's block or chunk), summing each
block's dE before adding it to the total, so that a kernel right only up to one block has its
line to break.  Chunks grow past :data:`MAX_CHUNKS` of them (see :func:`chunk_rows`).  The
mutants are the correct numpy code (or the correct torch module) with one flag switched on, so
that each differs from the correct one in exactly the line its bug names; :data:`LINEAR_CE_BUILTINS`
records each one's expected diagnosis label and the case (``exposes``) on which it shows.

Importing this module does not import torch: the torch classes are built by the first call of
a torch factory.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, cast

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CHUNK", "LINEAR_CE_BUILTINS", "LinearCEBuiltin", "LinearCEFunction",
           "LinearCEResult", "TorchLinearCEFactory", "builtin_target", "ce_bias_grad_wrong",
           "ce_dE_wrong", "ce_dh_wrong", "ce_grad_output_first", "ce_ignored_counted",
           "ce_ignored_not_zeroed", "ce_numpy", "ce_overflow", "ce_scale_dropped",
           "ce_scale_twice", "ce_smoothing_misweighted", "ce_softcap_derivative_missing",
           "ce_torch", "ce_torch_scale_dropped", "ce_z_loss_missing", "BLOCK",
           "ce_block_overwritten", "ce_ignore_index_hard_coded", "ce_torch_half_unmasked",
           "chunk_rows"]

#: Rows per chunk.  Not a power of two, so N and V in tests and checks are rarely multiples of
#: it and the partial last chunk (where kernels slip) is exercised.
CHUNK = 7
#: Tokens per block of the numpy form's grid (a real kernel's block, or a chunk of Liger's or
#: torchtune's): dE is summed per block, then across blocks.
BLOCK = 1024
#: Chunks grow past this many (each costs Python and, in torch, autograd nodes: 1158 chunks
#: of 7 at N = 8101 cost seconds), staying a size of their own, rarely a power of two.
MAX_CHUNKS = 16


def chunk_rows(N: int) -> int:
    """Rows per chunk for N tokens: CHUNK, or N / MAX_CHUNKS rounded up past MAX_CHUNKS chunks."""
    return max(CHUNK, -(-N // MAX_CHUNKS))

Array = npt.NDArray[Any]
Reduction = Literal["mean", "sum", "none"]

# The one deviation a numpy mutant makes; None is the correct code.
_Bug = Literal["scale_dropped", "scale_twice", "softcap_derivative_missing",
               "smoothing_misweighted", "z_loss_missing", "ignored_counted",
               "ignored_not_zeroed", "dE_wrong", "dh_wrong", "bias_grad_wrong", "overflow",
               "block_overwritten", "ignore_index_hard_coded"]


class LinearCEResult(TypedDict):
    """What a numpy-form implementation returns.

    ``loss`` is a float for ``mean``/``sum`` and an ``[N]`` array for ``none``; ``db`` is None
    when no bias was passed.
    """

    loss: float | Array
    dh: Array
    dE: Array
    db: Array | None


class LinearCEFunction(Protocol):
    """The numpy function form (see the module docstring)."""

    def __call__(self, h: Array, E: Array, targets: Array, b: Array | None = None, *,
                 grad_output: Array | float | None = None, logit_scale: float = 1.0,
                 softcap: float | None = None, label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, ignore_index: int = -100,
                 reduction: Reduction = "mean",
                 ce_weight: Array | None = None) -> LinearCEResult: ...


class TorchLinearCEFactory(Protocol):
    """The torch class form: called like Liger's loss class, returns the loss module."""

    def __call__(self, ignore_index: int = -100, lse_square_scale: float = 0.0,
                 label_smoothing: float = 0.0, reduction: Reduction = "mean",
                 softcap: float | None = None, ce_weight: torch.Tensor | None = None,
                 logit_scale: float = 1.0) -> nn.Module: ...


@dataclass(frozen=True)
class LinearCEBuiltin:
    """One built-in linear-ce implementation: what it breaks, the label a check must reach.

    ``exposes`` holds the options of a case on which the bug shows (keyword arguments of the
    forms, e.g. ``{"logit_scale": 0.0625}``), plus, where the bug needs them, keys about the
    batch rather than the options: ``"ignored_fraction"`` (the fraction of tokens whose target
    is ``ignore_index``), ``"bias"`` (True: pass ``b``), ``"logit_magnitude"`` (the size of the
    logits ``|h @ E.T|`` the case must reach), ``"tokens"`` (the N it needs) and ``"dtype"``
    (the inputs' dtype).  Empty when any case shows it.
    """

    name: str  # e.g. "ce-numpy", "ce-scale-dropped"
    attr: str  # this module's attribute holding the function or the torch factory
    form: Literal["numpy", "torch"]
    description: str
    breaks: str | None  # the option or part of the contract it breaks; None when correct
    expected: str  # the diagnosis label a check must reach ("correct" for correct ones)
    exposes: dict[str, object] = field(default_factory=dict)


# --- the numpy form --------------------------------------------------------------------------

def _linear_ce(h: Array, E: Array, targets: Array, b: Array | None, *,
               grad_output: Array | float | None, logit_scale: float, softcap: float | None,
               label_smoothing: float, lse_square_scale: float, ignore_index: int,
               reduction: Reduction, ce_weight: Array | None,
               bug: _Bug | None) -> LinearCEResult:
    """The chunked forward and hand-derived backward; ``bug`` switches on one mutant's slip."""
    # the naive exp's overflow is its bug, reported through inf/nan results as a GPU kernel
    # would, not through numpy's RuntimeWarnings
    quiet = bug == "overflow"
    with np.errstate(over="ignore", invalid="ignore") if quiet else contextlib.nullcontext():
        return _linear_ce_body(h, E, targets, b, grad_output=grad_output,
                               logit_scale=logit_scale, softcap=softcap,
                               label_smoothing=label_smoothing,
                               lse_square_scale=lse_square_scale, ignore_index=ignore_index,
                               reduction=reduction, ce_weight=ce_weight, bug=bug)


def _linear_ce_body(h: Array, E: Array, targets: Array, b: Array | None, *,
                    grad_output: Array | float | None, logit_scale: float,
                    softcap: float | None, label_smoothing: float, lse_square_scale: float,
                    ignore_index: int, reduction: Reduction, ce_weight: Array | None,
                    bug: _Bug | None) -> LinearCEResult:
    dtype = np.result_type(h, E)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"h and E must be float32 or float64, not {dtype}")
    if bug == "ignore_index_hard_coded":
        ignore_index = -100  # the slip: the declared ignore_index is taken and never used
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    h = np.asarray(h, dtype)
    E = np.asarray(E, dtype)
    y = np.asarray(targets).astype(np.int64).reshape(-1)
    (N, d), V = h.shape, E.shape[0]
    s, eps, lam = float(logit_scale), float(label_smoothing), float(lse_square_scale)
    bias = None if b is None else np.asarray(b, dtype).reshape(V)

    valid = y != ignore_index
    # an ignored token's target may be anything (-100, or out of range): index with 0 instead
    y_safe = np.where(valid, y, 0)
    if np.any(y_safe < 0) or np.any(y_safe >= V):
        raise IndexError(f"a target that is not ignore_index lies outside [0, {V})")
    w = np.ones(V, dtype) if ce_weight is None else np.asarray(ce_weight, dtype).reshape(V)
    t = np.where(valid, w[y_safe], 0).astype(dtype)

    # norm[i]: dL/d(t_i l_i), i.e. the factor a weight-1 token's loss enters L with
    if reduction == "mean":
        D = t.sum(dtype=dtype)
        if bug == "ignored_counted":
            # the slip: the denominator is every token (sum of weights plus the ignored ones),
            # the way dividing by target.numel() does; forward and backward agree on it
            D = D + dtype.type(np.count_nonzero(~valid))
        # all ignored: D = 0 and L is defined as 0, so every token's factor is 0 too
        norm = np.full(N, 1 / D if D > 0 else 0, dtype)
    elif reduction == "sum":
        norm = np.ones(N, dtype)
    else:
        norm = (np.ones(N, dtype) if grad_output is None
                else np.asarray(grad_output, dtype).reshape(N).copy())
    if reduction != "none" and grad_output is not None:
        norm = norm * np.asarray(grad_output, dtype).reshape(())
    coef = t * norm

    if bug == "scale_dropped":
        chain_scale = 1.0  # the slip of unsloth-zoo PR #930: s applied in the forward only
    elif bug == "scale_twice":
        chain_scale = s * s  # the slip: s applied to the logits' gradient and again after
    else:
        chain_scale = s

    dh = np.zeros((N, d), dtype)
    dE = np.zeros((V, d), dtype)
    db = None if bias is None else np.zeros(V, dtype)
    tl = np.zeros(N, dtype)  # t_i l_i
    # dE_wrong reads the logits' gradient from a chunk-sized buffer that the last chunk has
    # not yet written (zeros when there is no previous chunk)
    step = chunk_rows(N)
    buffer = np.zeros((step, V), dtype)
    # a real kernel's grid: blocks of BLOCK tokens, each walked in chunks of `step` rows, its
    # dE summed into the block's own buffer and then into dE (the same chunks as one walk
    # below BLOCK tokens)
    starts = [(block, start) for block in range(0, N, BLOCK)
              for start in range(block, min(block + BLOCK, N), step)]
    last_start = starts[-1][1] if starts else -1
    block_dE = np.zeros((V, d), dtype)

    for block, start in starts:
        if start == block:
            block_dE[:] = 0
        rows = slice(start, min(start + step, N, block + BLOCK))
        n = rows.stop - start
        idx = np.arange(n)
        hr, yr = h[rows], y_safe[rows]
        u = hr @ E.T
        if bias is not None:
            u = u + bias
        a = s * u
        if softcap is not None:
            th = np.tanh(a / softcap)
            z = softcap * th
        else:
            z = a
        if bug == "overflow":
            # the slip: exp without subtracting the row maximum; overflows beyond |z| ~ 88
            # (float32) or ~ 709 (float64), giving inf/inf = nan
            ez = np.exp(z)
            se = ez.sum(axis=1)
            lse = np.log(se)
        else:
            m = z.max(axis=1)
            ez = np.exp(z - m[:, None])
            se = ez.sum(axis=1)
            lse = m + np.log(se)
        p = ez / se[:, None]

        zy = z[idx, yr]
        lr = lse - (1 - eps) * zy - eps * z.mean(axis=1) + lam * lse * lse
        # where(): an ignored row's loss never reaches L, even were it not finite
        tl[rows] = np.where(valid[rows], t[rows] * lr, 0)

        # dl/dz: softmax * dl/dlse, minus the target's and the smoothing's shares
        # (z_loss_missing: the slip drops the z-loss's 2 lam lse from dl/dlse)
        dlse = np.ones_like(lse) if bug == "z_loss_missing" else 1 + 2 * lam * lse
        base = p * dlse[:, None]
        target_weight = 1.0 if bug == "smoothing_misweighted" else 1 - eps
        base[idx, yr] -= target_weight
        if eps:
            base -= eps / V
        gz = base * coef[rows, None]
        if bug == "ignored_not_zeroed":
            # the slip of Liger #968: ignored rows keep softmax(z) (their lse's gradient);
            # only the target term is masked
            gz = gz + p * np.where(valid[rows], 0, norm[rows])[:, None]
        if softcap is not None and bug != "softcap_derivative_missing":
            dzda = 1 - th * th
        else:
            dzda = None  # no softcap (dz/da = 1), or the slip: tanh's derivative left out

        def to_logits(g: Array, dzda: Array | None = dzda) -> Array:
            # dL/dz -> dL/du, u = h @ E.T + b
            return (g if dzda is None else g * dzda) * chain_scale

        g = to_logits(gz)
        if not (bug == "dh_wrong" and start == last_start):
            # (dh_wrong: the last chunk's dh is never written and stays zero)
            dh[rows] = g @ E
        g_for_dE = buffer[:n] if bug == "dE_wrong" and start == last_start else g
        block_dE += g_for_dE.T @ hr
        if rows.stop == min(block + BLOCK, N):  # the block's last chunk
            if bug == "block_overwritten":
                dE = block_dE.copy()  # the slip: `dE = block_dE` where `dE += block_dE` was meant
            else:
                dE += block_dE
        if bug == "dE_wrong":
            buffer[:n] = g  # (after the read above: buffer[:n] is a view)
        if db is not None:
            if bug == "bias_grad_wrong":
                # the slip: db summed over every row's gradient without its token weight t_i,
                # ignored rows included
                db += to_logits(base * norm[rows, None]).sum(axis=0)
            else:
                db += g.sum(axis=0)

    if reduction == "none":
        loss: float | Array = tl
    elif reduction == "sum":
        loss = float(tl.sum(dtype=dtype))
    else:
        loss = float(tl.sum(dtype=dtype) / D) if D > 0 else 0.0
    return LinearCEResult(loss=loss, dh=dh, dE=dE, db=db)


def ce_numpy(h: Array, E: Array, targets: Array, b: Array | None = None, *,
             grad_output: Array | float | None = None, logit_scale: float = 1.0,
             softcap: float | None = None, label_smoothing: float = 0.0,
             lse_square_scale: float = 0.0, ignore_index: int = -100,
             reduction: Reduction = "mean", ce_weight: Array | None = None) -> LinearCEResult:
    """Correct chunked linear cross-entropy, numpy form, every option (see the module docstring).

    The backward is derived by hand: with ``p = softmax(z_i)``,
    ``dL/du_i = t_i/D (p (1 + 2 lam lse_i) - (1 - eps) onehot(y_i) - eps/V) (1 - tanh(a/c)^2) s``
    (``t_i`` for sum, ``t_i go_i`` for none), then ``dh = G @ E``, ``dE = G.T @ h``,
    ``db = sum_i G_i``.
    """
    return _linear_ce(h, E, targets, b, grad_output=grad_output, logit_scale=logit_scale,
                      softcap=softcap, label_smoothing=label_smoothing,
                      lse_square_scale=lse_square_scale, ignore_index=ignore_index,
                      reduction=reduction, ce_weight=ce_weight, bug=None)


def _numpy_mutant(bug: _Bug, name: str, doc: str) -> LinearCEFunction:
    # One signature for every mutant (they all declare every option: each supports them all,
    # and declaring fewer would tell a checker not to try the option that exposes the bug).
    def mutant(h: Array, E: Array, targets: Array, b: Array | None = None, *,
               grad_output: Array | float | None = None, logit_scale: float = 1.0,
               softcap: float | None = None, label_smoothing: float = 0.0,
               lse_square_scale: float = 0.0, ignore_index: int = -100,
               reduction: Reduction = "mean",
               ce_weight: Array | None = None) -> LinearCEResult:
        return _linear_ce(h, E, targets, b, grad_output=grad_output, logit_scale=logit_scale,
                          softcap=softcap, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, ignore_index=ignore_index,
                          reduction=reduction, ce_weight=ce_weight, bug=bug)

    mutant.__name__ = mutant.__qualname__ = name
    mutant.__doc__ = doc
    return mutant


ce_scale_dropped = _numpy_mutant(
    "scale_dropped", "ce_scale_dropped",
    "Broken: the backward leaves out logit_scale (the loss is right), so every gradient is "
    "1/s too large (unsloth-zoo PR #930: s = 0.0625, tied gradient 16x).")
ce_scale_twice = _numpy_mutant(
    "scale_twice", "ce_scale_twice",
    "Broken: the backward multiplies by logit_scale twice, so every gradient is s times too "
    "large (too small for s < 1).")
ce_softcap_derivative_missing = _numpy_mutant(
    "softcap_derivative_missing", "ce_softcap_derivative_missing",
    "Broken: the backward leaves out softcap's derivative 1 - tanh(a/c)^2.")
ce_smoothing_misweighted = _numpy_mutant(
    "smoothing_misweighted", "ce_smoothing_misweighted",
    "Broken: the backward weights the target's one-hot by 1 instead of 1 - label_smoothing.")
ce_z_loss_missing = _numpy_mutant(
    "z_loss_missing", "ce_z_loss_missing",
    "Broken: the z-loss lam * lse^2 is in the loss but not in the backward (no 2 lam lse).")
ce_ignored_counted = _numpy_mutant(
    "ignored_counted", "ce_ignored_counted",
    "Broken: the mean divides by the sum of the weights plus the number of ignored tokens, "
    "forward and backward alike (ROCm TransformerEngine PR #336).")
ce_ignored_not_zeroed = _numpy_mutant(
    "ignored_not_zeroed", "ce_ignored_not_zeroed",
    "Broken: ignored tokens still send softmax(z) (their lse's gradient, without the target "
    "term) into the gradients with weight 1/D; the loss is right (Liger #968).")
ce_dE_wrong = _numpy_mutant(
    "dE_wrong", "ce_dE_wrong",
    "Broken: dE's contribution from the last chunk uses the previous chunk's logit gradient "
    "(a chunk-sized buffer read before the last chunk writes it: zeros if there is one chunk); "
    "dh, db and the loss are right.")
ce_dh_wrong = _numpy_mutant(
    "dh_wrong", "ce_dh_wrong",
    "Broken: the last chunk's rows of dh are never written (zeros); dE, db and the loss are "
    "right.")
ce_bias_grad_wrong = _numpy_mutant(
    "bias_grad_wrong", "ce_bias_grad_wrong",
    "Broken: db sums every row's logit gradient without its token weight t_i, ignored rows "
    "included; dh, dE and the loss are right.")
ce_block_overwritten = _numpy_mutant(
    "block_overwritten", "ce_block_overwritten",
    "Broken: each block of BLOCK = 1024 tokens assigns dE = block_dE where dE += block_dE was "
    "meant, so dE is the last block's contribution alone; right whenever N <= 1024.")
ce_ignore_index_hard_coded = _numpy_mutant(
    "ignore_index_hard_coded", "ce_ignore_index_hard_coded",
    "Broken: declares ignore_index but ignores the targets equal to -100 whatever it is given; "
    "right whenever ignore_index is -100.")
ce_overflow = _numpy_mutant(
    "overflow", "ce_overflow",
    "Broken: logsumexp and softmax as a naive exp without the max shift: inf/nan once |logit| "
    "passes ~88 in float32 (and ~709 in float64); exact below that.")


# --- the torch form --------------------------------------------------------------------------

# The classes are built on first use so that importing this module does not import torch.

@functools.cache
def _torch_classes() -> dict[str, type[nn.Module]]:
    import torch
    from torch import Tensor, nn

    class ChunkedLinearCE(nn.Module):
        # The correct torch form: chunks of CHUNK rows, one chunk's logits at a time, plain
        # autograd inside.  `scale_in_graph` and `half_unmasked` are the mutants' switches.
        scale_in_graph = True
        half_unmasked = False

        def __init__(self, ignore_index: int = -100, lse_square_scale: float = 0.0,
                     label_smoothing: float = 0.0, reduction: Reduction = "mean",
                     softcap: float | None = None, ce_weight: Tensor | None = None,
                     logit_scale: float = 1.0) -> None:
            super().__init__()
            if reduction not in ("mean", "sum", "none"):
                raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
            self.ignore_index = ignore_index
            self.lse_square_scale = float(lse_square_scale)
            self.label_smoothing = float(label_smoothing)
            self.reduction = reduction
            self.softcap = None if softcap is None else float(softcap)
            self.ce_weight = ce_weight
            self.logit_scale = float(logit_scale)

        def token_weights(self, target: Tensor, V: int,
                          dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
            """(t, the safe targets, the mean's denominator made safe for all-ignored)."""
            valid = target != self.ignore_index
            y = torch.where(valid, target, torch.zeros_like(target))
            if bool(((y < 0) | (y >= V)).any()):
                raise IndexError(f"a target that is not ignore_index lies outside [0, {V})")
            w = (torch.ones(V, dtype=dtype, device=target.device) if self.ce_weight is None
                 else self.ce_weight.to(dtype=dtype, device=target.device))
            t = torch.where(valid, w[y], torch.zeros((), dtype=dtype, device=target.device))
            D = t.sum()
            # all ignored: the numerator is 0 (every t_i is), so dividing by 1 makes L = 0
            return t, y, torch.where(D > 0, D, torch.ones_like(D))

        def row_losses(self, u: Tensor, y: Tensor, t: Tensor) -> Tensor:
            """t_i l_i for one chunk's unscaled logits ``u = h @ W.T + b``."""
            s = self.logit_scale
            if self.scale_in_graph:
                a = u * s
            else:
                # the slip: the logits are rescaled in place where autograd does not see it
                # (as a kernel rescaling its logits buffer does), so the backward lacks s
                with torch.no_grad():
                    u.mul_(s)
                a = u
            c = self.softcap
            z = a if c is None else c * torch.tanh(a / c)
            lse = torch.logsumexp(z, dim=-1)
            eps, lam = self.label_smoothing, self.lse_square_scale
            zy = z.gather(1, y[:, None])[:, 0]
            loss = lse - (1 - eps) * zy - eps * z.mean(dim=-1) + lam * lse * lse
            tl = t * loss
            if self.half_unmasked and u.dtype in (torch.bfloat16, torch.float16):
                # the slip, in the half-precision branch only (float32 and float64 are right):
                # the weight-0 (ignored) rows' lse reaches the backward with weight 1, its value
                # masked out (Liger #968's shape); zero in value, softmax in gradient
                dead = torch.where(t == 0, lse, torch.zeros_like(lse))
                tl = tl + (dead - dead.detach())
            return tl

        def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor,
                    bias: Tensor | None = None) -> Tensor:
            N, V = _input.shape[0], lin_weight.shape[0]
            t, y, D = self.token_weights(target.reshape(-1), V, _input.dtype)
            parts = []
            step = chunk_rows(N)
            for start in range(0, N, step):
                rows = slice(start, start + step)
                u = _input[rows] @ lin_weight.T
                if bias is not None:
                    u = u + bias
                parts.append(self.row_losses(u, y[rows], t[rows]))
            tl = torch.cat(parts) if parts else _input.new_zeros(0)
            if self.reduction == "none":
                return tl
            return tl.sum() if self.reduction == "sum" else tl.sum() / D

    class ScaleDropped(ChunkedLinearCE):
        scale_in_graph = False

    class HalfUnmasked(ChunkedLinearCE):
        half_unmasked = True

    class PrecomputedGrad(torch.autograd.Function):
        # Fused-kernel style: the forward computes the loss and, chunk by chunk, the gradient
        # of the logits G (N x V) as if grad_output were 1; the backward only rescales G by
        # grad_output and contracts it with h and W.

        @staticmethod
        def forward(ctx: Any, h: Tensor, W: Tensor, bias: Tensor | None, target: Tensor,
                    module: FusedLinearCE) -> Tensor:
            N, V = h.shape[0], W.shape[0]
            t, y, D = module.token_weights(target.reshape(-1), V, h.dtype)
            G = h.new_zeros(N, V)
            parts = []
            step = chunk_rows(N)
            for start in range(0, N, step):
                rows = slice(start, start + step)
                u = h[rows] @ W.T  # grad mode is off in a Function's forward
                if bias is not None:
                    u = u + bias
                u.requires_grad_(True)
                with torch.enable_grad():
                    tl = module.row_losses(u, y[rows], t[rows])
                    total = tl.sum() if module.reduction != "mean" else tl.sum() / D
                    (G[rows],) = torch.autograd.grad(total, u)
                parts.append(tl.detach())
            tl = torch.cat(parts) if parts else h.new_zeros(0)
            ctx.save_for_backward(h, W, G)
            ctx.has_bias = bias is not None
            ctx.first_only = module.grad_output_first
            if module.reduction == "none":
                return tl
            return tl.sum() if module.reduction == "sum" else tl.sum() / D

        @staticmethod
        def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
            h, W, G = ctx.saved_tensors
            if ctx.first_only:
                # the slip of Liger PR #1298: the kernel loads one scalar from grad_output's
                # pointer, right for mean/sum, wrong for none's per-token grad_output
                G = G * grad_output.reshape(-1)[0]
            elif grad_output.ndim:
                G = G * grad_output[:, None]
            else:
                G = G * grad_output
            db = G.sum(dim=0) if ctx.has_bias else None
            return G @ W, G.T @ h, db, None, None

    class FusedLinearCE(ChunkedLinearCE):
        # Same loss, gradients through PrecomputedGrad; `grad_output_first` is the slip.
        grad_output_first = False

        def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor,
                    bias: Tensor | None = None) -> Tensor:
            out = PrecomputedGrad.apply(  # type: ignore[no-untyped-call]
                _input, lin_weight, bias, target, self)
            return cast(Tensor, out)

    class GradOutputFirst(FusedLinearCE):
        grad_output_first = True

    return {"ChunkedLinearCE": ChunkedLinearCE, "ScaleDropped": ScaleDropped,
            "HalfUnmasked": HalfUnmasked,
            "FusedLinearCE": FusedLinearCE, "GradOutputFirst": GradOutputFirst}


def _torch_factory(cls_name: str, name: str, doc: str) -> TorchLinearCEFactory:
    # Liger's constructor signature, spelled out so that its keywords (the options) are visible
    # without importing torch; the class itself is built on the first call.
    def factory(ignore_index: int = -100, lse_square_scale: float = 0.0,
                label_smoothing: float = 0.0, reduction: Reduction = "mean",
                softcap: float | None = None, ce_weight: torch.Tensor | None = None,
                logit_scale: float = 1.0) -> nn.Module:
        return _torch_classes()[cls_name](
            ignore_index=ignore_index, lse_square_scale=lse_square_scale,
            label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
            ce_weight=ce_weight, logit_scale=logit_scale)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


ce_torch = _torch_factory(
    "ChunkedLinearCE", "ce_torch",
    "Correct chunked linear cross-entropy, torch form (Liger's calling convention), every "
    "option: ``ce_torch(...)(lin_weight, _input, target, bias=None)`` returns the loss.")
ce_torch_scale_dropped = _torch_factory(
    "ScaleDropped", "ce_torch_scale_dropped",
    "Broken torch form: the logits are scaled in place under no_grad, so autograd's gradient "
    "lacks logit_scale (the loss is right).")
ce_torch_half_unmasked = _torch_factory(
    "HalfUnmasked", "ce_torch_half_unmasked",
    "Broken torch form, in its bfloat16/float16 branch only: ignored tokens' lse still reaches "
    "the backward (their softmax enters dh, dE and db); float32 and float64 are right.")
ce_grad_output_first = _torch_factory(
    "GradOutputFirst", "ce_grad_output_first",
    "Broken torch form: a custom autograd.Function whose backward scales every row by "
    "grad_output[0] (Liger PR #1298); right for mean/sum, wrong for reduction='none'.")
# The same custom Function with the slip switched off: correct (the tests pin that, so the
# mutant above differs from correct code in the one line).  Not a listed built-in.
_ce_torch_fused = _torch_factory(
    "FusedLinearCE", "_ce_torch_fused",
    "Correct torch form through a custom autograd.Function that computes the logits' gradient "
    "in the forward, as fused kernels do.")


# --- the catalogue ---------------------------------------------------------------------------

_IGNORED = 0.25  # a quarter of the tokens ignored: enough that every chunk is likely to hold one

LINEAR_CE_BUILTINS: dict[str, LinearCEBuiltin] = {b.name: b for b in [
    LinearCEBuiltin("ce-numpy", "ce_numpy", "numpy",
                    "chunked numpy linear cross-entropy, hand-derived backward, every option",
                    None, "correct"),
    LinearCEBuiltin("ce-torch", "ce_torch", "torch",
                    "chunked torch module (Liger's convention), autograd per chunk, every option",
                    None, "correct"),
    LinearCEBuiltin("ce-scale-dropped", "ce_scale_dropped", "numpy",
                    "backward omits logit_scale: gradients 1/s too large (unsloth-zoo PR #930)",
                    "logit_scale", "logit_scale_dropped", {"logit_scale": 0.0625}),
    LinearCEBuiltin("ce-scale-twice", "ce_scale_twice", "numpy",
                    "backward multiplies by logit_scale twice: gradients s times too large",
                    "logit_scale", "logit_scale_twice", {"logit_scale": 0.0625}),
    # softcap 2: logits of a few units then reach tanh's curved part, so 1 - tanh^2 is far
    # from 1 (Gemma 2's 30 would need logits of tens to show as clearly)
    LinearCEBuiltin("ce-softcap-derivative-missing", "ce_softcap_derivative_missing", "numpy",
                    "backward omits softcap's derivative 1 - tanh(a/c)^2",
                    "softcap", "softcap_derivative_missing", {"softcap": 2.0}),
    LinearCEBuiltin("ce-smoothing-misweighted", "ce_smoothing_misweighted", "numpy",
                    "backward weights the target one-hot by 1, not 1 - label_smoothing",
                    "label_smoothing", "label_smoothing_misweighted", {"label_smoothing": 0.1}),
    # lam 0.01 rather than PaLM's 1e-4: 2 lam lse is then a few percent of the gradient,
    # far outside float32's tolerance as well as float64's
    LinearCEBuiltin("ce-z-loss-missing", "ce_z_loss_missing", "numpy",
                    "z-loss lam lse^2 in the forward, missing from the backward",
                    "lse_square_scale", "z_loss_missing", {"lse_square_scale": 0.01}),
    LinearCEBuiltin("ce-ignored-counted", "ce_ignored_counted", "numpy",
                    "mean divides by all tokens, ignored ones included (ROCm TE PR #336)",
                    "ignore_index", "ignored_counted_in_mean",
                    {"reduction": "mean", "ignored_fraction": _IGNORED}),
    LinearCEBuiltin("ce-ignored-not-zeroed", "ce_ignored_not_zeroed", "numpy",
                    "ignored tokens still contribute softmax(z)/D to the gradients (Liger #968)",
                    "ignore_index", "ignored_not_zeroed", {"ignored_fraction": _IGNORED}),
    LinearCEBuiltin("ce-grad-output-first", "ce_grad_output_first", "torch",
                    "custom Function scales every row by grad_output[0] (Liger PR #1298)",
                    "grad_output", "grad_output_broadcast", {"reduction": "none"}),
    LinearCEBuiltin("ce-dE-wrong", "ce_dE_wrong", "numpy",
                    "last chunk's dE uses the previous chunk's logit gradient; dh right",
                    "dE", "dE_wrong_dh_right"),
    LinearCEBuiltin("ce-dh-wrong", "ce_dh_wrong", "numpy",
                    "last chunk's dh rows never written (zeros); dE right",
                    "dh", "dh_wrong_dE_right"),
    LinearCEBuiltin("ce-bias-grad-wrong", "ce_bias_grad_wrong", "numpy",
                    "db summed without the token weights t_i, ignored tokens included",
                    "db", "bias_gradient_wrong", {"bias": True, "ignored_fraction": _IGNORED}),
    LinearCEBuiltin("ce-overflow", "ce_overflow", "numpy",
                    "naive exp without the max shift: inf/nan at |logit| ~ 1e4",
                    "stability", "not_finite", {"logit_magnitude": 1e4}),
    LinearCEBuiltin("ce-torch-scale-dropped", "ce_torch_scale_dropped", "torch",
                    "logits scaled in place under no_grad: gradients 1/s too large",
                    "logit_scale", "logit_scale_dropped", {"logit_scale": 0.0625}),
    # a kernel right only up to one block: the standard cases' N = 8101 is past seven of them
    LinearCEBuiltin("ce-block-overwritten", "ce_block_overwritten", "numpy",
                    "each block of 1024 tokens overwrites dE (`dE = block_dE`): right to N = 1024",
                    "dE", "dE_wrong_dh_right", {"tokens": 8101}),
    LinearCEBuiltin("ce-torch-half-unmasked", "ce_torch_half_unmasked", "torch",
                    "bfloat16/float16 branch lets ignored tokens' softmax into the gradients",
                    "ignore_index", "ignored_not_zeroed",
                    {"ignored_fraction": _IGNORED, "dtype": "bfloat16"}),
    LinearCEBuiltin("ce-ignore-index-hard-coded", "ce_ignore_index_hard_coded", "numpy",
                    "declares ignore_index, ignores -100 whatever it is given",
                    "ignore_index", "ignored_not_zeroed",
                    {"ignore_index": 5, "ignored_fraction": _IGNORED}),
]}


def builtin_target(name: str) -> LinearCEFunction | TorchLinearCEFactory:
    """The numpy function or torch factory of the built-in called ``name``."""
    if name not in LINEAR_CE_BUILTINS:
        raise KeyError(f"no linear-ce built-in named {name!r}; "
                       f"known: {', '.join(LINEAR_CE_BUILTINS)}")
    return cast("LinearCEFunction | TorchLinearCEFactory",
                globals()[LINEAR_CE_BUILTINS[name].attr])
