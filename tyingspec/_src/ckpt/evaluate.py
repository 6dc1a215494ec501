"""``--evaluate``: load the converted tensors into the user's model factory and compare
losses on a token file.  Whatever the factory raises, ``sys.exit`` included, is a one-line
:class:`CkptError`."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tyingspec._src.ckpt.convert import Terminated, convert
from tyingspec._src.ckpt.inspect import inspect
from tyingspec._src.ckpt.read import POLICIES, Checkpoint, CkptError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

@contextlib.contextmanager
def _guarded(spec: str, during: str) -> Iterator[None]:
    """The user's code (its import, the factory, load_state_dict, the forward) runs in here:
    whatever it raises, ``sys.exit`` included, is a :class:`CkptError` naming the factory,
    never a traceback or an exit status of the user's choosing (``SystemExit(0)`` would read as
    a written OUT)."""
    try:
        yield
    except (CkptError, KeyboardInterrupt, Terminated):
        raise
    except SystemExit as exc:
        raise CkptError(f"--evaluate {spec}: {during} called sys.exit({exc.code!r}); expected "
                        f"it to return") from exc
    except BaseException as exc:
        raise CkptError(f"--evaluate {spec}: {during} raised {first_line(exc)}") from exc


def _factory(spec: str) -> nn.Module:
    from torch import nn

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CkptError(f"--evaluate: expected module:attr, got {spec!r}")
    try:
        with _guarded(spec, "importing it"):
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
    except CkptError as exc:
        if isinstance(exc.__cause__, ImportError | AttributeError):
            raise CkptError(f"--evaluate {spec}: cannot be imported ({exc.__cause__})") from exc
        raise
    with _guarded(spec, "the factory"):
        model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(model, nn.Module):
        raise CkptError(f"--evaluate {spec}: expected a zero-argument factory returning an "
                        f"nn.Module, got {type(model).__name__}")
    return model


def read_tokens(path: str) -> torch.Tensor:
    """Token ids from a ``.npy`` array (1-D or one sequence per row) or a text file."""
    import numpy as np
    import torch

    try:
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        else:
            with open(path, encoding="utf-8") as fh:
                arr = np.array([int(t) for t in fh.read().replace(",", " ").split()])
    except (OSError, ValueError, EOFError) as exc:
        raise CkptError(f"--tokens {path}: expected integer token ids ({exc})") from exc
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2) or arr.size < 2:
        raise CkptError(f"--tokens {path}: expected at least 2 integer ids in a 1-D or 2-D "
                        f"array, got dtype {arr.dtype} and shape {list(arr.shape)}")
    if arr.ndim == 2 and arr.shape[1] < 2:
        # a row of one id has no next-token target: its mean loss is 0/0 = NaN
        raise CkptError(f"--tokens {path}: expected at least 2 ids per row (an input and its "
                        f"next-token target), got shape {list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise CkptError(f"--tokens {path}: token id {int(arr.max())} does not fit int64")
    return torch.from_numpy(arr.astype(np.int64))


def _windows(tokens: torch.Tensor, model: nn.Module) -> torch.Tensor:
    if tokens.dim() == 2:
        return tokens
    config = getattr(model, "config", None)
    block = getattr(config, "block_size", None) or getattr(config, "n_positions", None)
    if not isinstance(block, int) or block < 1:
        block = None
    length = min(block, tokens.numel() - 1) if block else tokens.numel() - 1
    rows = (tokens.numel() - 1) // length
    return tokens[: rows * length + 1].unfold(0, length + 1, length)[:rows]


def _load_into(spec: str, tensors: dict[str, torch.Tensor], emb: str, hd: str,
               untie: bool) -> nn.Module:
    import torch
    from torch import nn

    model = _factory(spec)
    try:
        with _guarded(spec, "load_state_dict"):
            model.load_state_dict(tensors, strict=False)
    except CkptError as exc:
        if isinstance(exc.__cause__, RuntimeError):
            raise CkptError(f"--evaluate {spec}: the checkpoint does not fit the model: "
                            f"{first_line(exc.__cause__)}") from exc
        raise
    params = dict(model.named_parameters(remove_duplicate=False))
    if emb not in params or hd not in params:
        raise CkptError(f"--evaluate {spec}: the model has no parameter "
                        f"{emb if emb not in params else hd!r}")
    with _guarded(spec, "re-tying its parameters"):
        if untie and params[emb] is params[hd]:
            # the original holds two matrices: give the head its own so the model computes
            # them
            owner = model.get_submodule(hd.rpartition(".")[0])
            owner.weight = nn.Parameter(tensors[hd].detach().clone())
        # load_state_dict wrote both names into a tying model's one Parameter, the head last
        # (the key-order bug): the embedding is set from its own tensor, the head as given
        with torch.no_grad():
            dict(model.named_parameters(remove_duplicate=False))[emb].copy_(tensors[emb])
    return model


def _loss(model: nn.Module, windows: torch.Tensor, spec: str, name: str) -> float:
    import torch
    from torch.nn import functional as F

    with _guarded(spec, "the model's forward"):
        model = model.double().eval()
        with torch.no_grad():
            out = model(windows[:, :-1])
    logits = out[0] if isinstance(out, tuple) and out else getattr(out, "logits", out)
    want = [*windows[:, :-1].shape]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or [*logits.shape[:2]] != want:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise CkptError(f"--evaluate {spec}: expected the forward to return logits of shape "
                        f"[{want[0]}, {want[1]}, vocab] (or a tuple or output whose first item "
                        f"or .logits they are), got {got}")
    if logits.shape[-1] <= int(windows.max()):
        raise CkptError(f"--tokens: token id {int(windows.max())} is outside the model's "
                        f"vocabulary of {logits.shape[-1]}")
    loss = float(F.cross_entropy(logits.to(torch.float64).reshape(-1, logits.shape[-1]),
                                 windows[:, 1:].reshape(-1)))
    if not math.isfinite(loss):
        # a NaN compares unequal to everything and would read as "no change": never a pass
        raise CkptError(f"--evaluate {spec}: the {name} model's loss on --tokens is {loss}; "
                        f"expected a finite number (a NaN or inf in the checkpoint's weights?)")
    return loss


def evaluate(ckpt: Checkpoint, spec: str, tokens: torch.Tensor, tolerance: float | None = None,
             config: dict[str, Any] | None = None, embedding: str | None = None,
             head: str | None = None) -> list[tuple[str, float | None]]:
    """Mean cross-entropy (float64) of the original and of each policy's tied model."""
    report = inspect(ckpt, config, embedding, head)
    emb, hd = report["pairs"][0]["embedding"], report["pairs"][0]["head"]
    untied = convert(ckpt, "untied", None, None, config, emb, hd)
    vocab = int(untied.tensors[emb].shape[0])
    if tokens.dim() == 2 and tokens.shape[1] < 2 or tokens.numel() < 2:
        raise CkptError(f"--tokens: expected at least 2 ids per sequence (an input and its "
                        f"next-token target), got shape {list(tokens.shape)}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise CkptError(f"--tokens: token id {low if low < 0 else high} is outside the "
                        f"vocabulary: expected ids 0..{vocab - 1} (the rows of the embedding "
                        f"{emb!r})")
    model = _load_into(spec, untied.tensors, emb, hd, untie=True)
    windows = _windows(tokens, model)
    rows: list[tuple[str, float | None]] = [("original", _loss(model, windows, spec,
                                                                "original"))]
    for policy in POLICIES:
        conv = convert(ckpt, "tied", policy, tolerance, config, emb, hd)
        if conv.refused:
            rows.append((policy, None))
            continue
        rows.append((policy, _loss(_load_into(spec, conv.tensors, emb, hd, untie=False),
                                   windows, spec, f"--policy {policy}")))
    return rows
