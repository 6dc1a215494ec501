"""An independent torch implementation of tyingspec's probe model, as model adapters.

    tyingspec check benchmarks.torch_probe:tied_f32 --precision float32      # from the repo root
    python -c "import benchmarks.torch_probe as m; print(m.ADAPTERS)"

Written from README.md's "probe model" section only (no tyingspec code is used)::

    x = s_in * E[tokens];  u = x @ W;  h = res * x + tanh(u)
    logits = h @ E.T (+ b);  loss = mean softmax cross-entropy

Every adapter computes in float32 with torch autograd and returns ``loss`` as a Python float.

- ``tied_f32``: correct; one leaf ``E`` used twice, autograd sums the two paths.
- ``tied_f32_upcast``: ``tied_f32`` with the gradients returned as float64 (a float32 result
  dressed as float64: at ``--precision auto`` every value it returns is a float32, so it is
  judged at float32 and correct; at ``--precision float64``, ``precision_limited``).
- ``input_path_dropped``: the untied twin (lookup table ``E_in``, head ``U``, both = E); dE is
  ``U``'s gradient only (the output path).
- ``one_token_twice_not_accumulated``: a custom lookup backward that, like numpy's buffered
  ``dE[tokens] += dx``, adds one occurrence per unique token (the last one).
- ``path_halved``: a custom lookup backward scaling the input path by 0.5.
- ``padding_row_masked``: a custom lookup backward that drops positions where ``tokens == 0``
  (``padding_idx=0`` left on), so row 0 gets no input path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Result = dict[str, Any]
Lookup = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _BrokenLookup(torch.autograd.Function):
    """``E[tokens]`` forward; the backward scatters ``dx`` into E's rows in a broken way."""

    @staticmethod
    def forward(ctx: Any, E: torch.Tensor, tokens: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.V, ctx.mode = E.shape[0], mode
        return E[tokens]

    @staticmethod
    def backward(ctx: Any, dx: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (tokens,) = ctx.saved_tensors
        dE = dx.new_zeros(ctx.V, dx.shape[1])
        if ctx.mode == "halved":
            dE.index_add_(0, tokens, 0.5 * dx)
        elif ctx.mode == "mask0":
            keep = tokens != 0
            dE.index_add_(0, tokens[keep], dx[keep])
        elif ctx.mode == "last":  # buffered dE[t] += dx: the last occurrence of each token wins
            pos = torch.arange(tokens.shape[0])
            last = torch.full((ctx.V,), -1, dtype=torch.long).scatter_reduce_(
                0, tokens, pos, reduce="amax")
            rows = torch.unique(tokens)
            dE[rows] = dx[last[rows]]
        else:
            raise ValueError(f"unknown mode {ctx.mode!r}")
        return dE, None, None


def _leaf(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.tensor(a, dtype=torch.float32, requires_grad=True)


def _loss(E_in: torch.Tensor, E_out: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None,
          tokens: torch.Tensor, targets: torch.Tensor, res: float, s_in: float,
          lookup: Lookup) -> torch.Tensor:
    """The probe model's mean cross-entropy, E_in read by ``lookup``, E_out scoring."""
    x = s_in * lookup(E_in, tokens)
    h = res * x + torch.tanh(x @ W)
    logits = h @ E_out.T
    if b is not None:
        logits = logits + b
    return F.cross_entropy(logits, targets)


def _run(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
         targets: np.ndarray, res: float, s_in: float, *, mode: str | None = None,
         untied: bool = False) -> Result:
    """Forward + backward in float32.  ``mode``: a broken lookup backward; ``untied``: the
    twin with a separate head ``U = E``, returning only the head's gradient as dE."""
    E_t, W_t, b_t = _leaf(E), _leaf(W), _leaf(b)
    assert E_t is not None and W_t is not None
    tok = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1))
    tgt = torch.as_tensor(np.asarray(targets, dtype=np.int64).reshape(-1))

    def lookup(e: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if mode is None:
            return e[t]
        rows: torch.Tensor = _BrokenLookup.apply(e, t, mode)  # type: ignore[no-untyped-call]
        return rows

    U = _leaf(E) if untied else E_t
    assert U is not None
    loss = _loss(E_t, U, W_t, b_t, tok, tgt, float(res), float(s_in), lookup)
    loss.backward()  # type: ignore[no-untyped-call]
    dE = U.grad if untied else E_t.grad
    return {"loss": float(loss.item()), "dE": dE, "dW": W_t.grad,
            "db": None if b_t is None else b_t.grad}


def tied_f32(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
             targets: np.ndarray, *, res: float, s_in: float) -> Result:
    """Correct: one float32 leaf used by the lookup and the head; autograd sums the paths."""
    return _run(E, W, b, tokens, targets, res, s_in)


def tied_f32_upcast(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
                    targets: np.ndarray, *, res: float, s_in: float) -> Result:
    """Correct float32 arithmetic, gradients returned as float64 arrays."""
    out = _run(E, W, b, tokens, targets, res, s_in)
    return {k: (v if v is None or isinstance(v, float) else v.double().numpy())
            for k, v in out.items()}


def input_path_dropped(E: np.ndarray, W: np.ndarray, b: np.ndarray | None,
                       tokens: np.ndarray, targets: np.ndarray, *, res: float,
                       s_in: float) -> Result:
    """Broken: dE is the untied twin's head gradient (output path) only."""
    return _run(E, W, b, tokens, targets, res, s_in, untied=True)


def one_token_twice_not_accumulated(E: np.ndarray, W: np.ndarray, b: np.ndarray | None,
                                    tokens: np.ndarray, targets: np.ndarray, *, res: float,
                                    s_in: float) -> Result:
    """Broken: a repeated token's row gets one occurrence of dx (the last), not all."""
    return _run(E, W, b, tokens, targets, res, s_in, mode="last")


def path_halved(E: np.ndarray, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray,
                targets: np.ndarray, *, res: float, s_in: float) -> Result:
    """Broken: the input path enters x0.5."""
    return _run(E, W, b, tokens, targets, res, s_in, mode="halved")


def padding_row_masked(E: np.ndarray, W: np.ndarray, b: np.ndarray | None,
                       tokens: np.ndarray, targets: np.ndarray, *, res: float,
                       s_in: float) -> Result:
    """Broken: positions with token 0 are masked out of the scatter (padding_idx=0)."""
    return _run(E, W, b, tokens, targets, res, s_in, mode="mask0")


#: name -> the label tyingspec should reach ("correct" for the right ones).
ADAPTERS: dict[str, str] = {
    "tied_f32": "correct",
    "tied_f32_upcast": "correct",
    "input_path_dropped": "input_path_missing",
    "one_token_twice_not_accumulated": "duplicates_not_accumulated",
    "path_halved": "path_scaled",
    "padding_row_masked": "input_path_wrong",
}
