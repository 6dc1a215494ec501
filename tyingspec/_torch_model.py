"""A user's ``nn.Module`` as tyingspec sees it: where the tie is, how the loss is taken.

Runs where the user's code runs (the worker process); imports torch.  Discovery never edits
the model it inspects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._adapters import AdapterError
from ._findings import Finding, failed, passed
from ._torch_target import TorchTarget

#: The invariant the discovery check guards.
ONE_PARAMETER = "the embedding and the head are one Parameter with one storage"

#: The longest sequence a check runs (a model's context may be thousands of positions).
MAX_SEQ_LEN = 16


@dataclass(frozen=True)
class Tie:
    """Where the tied matrix is used, and the batch a check runs."""

    embedding: str  # parameter name of the input use (an nn.Embedding's weight, usually)
    head: str  # parameter name of the output use
    vocab: int
    width: int
    padding_idx: int | None  # the embedding's padding_idx: its input path skips this row
    convention: str  # "labels" | "targets" | "logits" | "custom"
    batch_size: int
    seq_len: int
    how: str  # how the tie was found, for the report


def as_target(spec: str, obj: Any) -> TorchTarget:
    """A resolved attribute as a :class:`TorchTarget` (a bare factory gets the defaults)."""
    if isinstance(obj, TorchTarget):
        return obj
    if callable(obj):
        return TorchTarget(model=obj)
    raise AdapterError(spec, "is neither a model factory nor a TorchTarget",
                       expected="a zero-argument callable returning an nn.Module, or a "
                                "tyingspec.TorchTarget", got=type(obj).__name__)


def build_model(spec: str, target: TorchTarget, seed: int) -> nn.Module:
    """A fresh model from the target's factory, its initialisation drawn from ``seed``."""
    torch.manual_seed(seed)
    try:
        model = target.model()
    except Exception as exc:
        raise AdapterError(spec, "the model factory raised",
                           got=f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise AdapterError(spec, "the model factory returned something else",
                           expected="a torch.nn.Module", got=type(model).__name__)
    return model


def owner(model: nn.Module, name: str) -> nn.Module:
    """The module holding parameter ``name`` (the model itself for a top-level one)."""
    prefix = name.rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


def _name_of(model: nn.Module, param: nn.Parameter) -> str | None:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return None


def _module_weight_name(model: nn.Module, getter: str) -> tuple[str | None, Any]:
    """The parameter name of ``model.get_input_embeddings().weight`` (or output)."""
    get = getattr(model, getter, None)
    if not callable(get):
        return None, None
    try:
        module = get()
    except Exception:  # noqa: BLE001  (a model may not implement it: not a tie)
        return None, None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return None, None
    return _name_of(model, weight), weight


def _declared(model: nn.Module) -> str | None:
    """Where the model declares a tie it should have (transformers' config or keys)."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) is True:
        return "config.tie_word_embeddings is True"
    keys = getattr(model, "_tied_weights_keys", None)
    if keys:
        return f"_tied_weights_keys = {keys!r}"
    return None


def _pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(embedding-like, head-like) names: nn.Embedding weights against 2-D weights of the same
    shape elsewhere (an output projection)."""
    emb = [(f"{m}.weight" if m else "weight", mod.weight) for m, mod in model.named_modules()
           if isinstance(mod, nn.Embedding)]
    out: list[tuple[str, str]] = []
    for name, w in emb:
        for other, p in model.named_parameters(remove_duplicate=False):
            if other != name and p is not w and p.dim() == 2 and p.shape == w.shape:
                out.append((name, other))
    return out


def _is_embedding_use(model: nn.Module, name: str) -> bool:
    return isinstance(owner(model, name), nn.Embedding)


def find_tie(spec: str, model: nn.Module, target: TorchTarget) -> tuple[str, str, str, Finding]:
    """The tied pair ``(embedding, head, how)`` and the discovery finding: passed when they are
    one Parameter, failed (``tie_is_a_copy``) when a tie is declared or apparent but they are
    two.  AdapterError (exit 2) when the model has no tie at all."""
    check = "tie discovered"
    if target.embedding or target.head:
        if not (target.embedding and target.head):
            raise AdapterError(spec, "TorchTarget names one use of the tie",
                               expected="both embedding= and head=",
                               got=f"embedding={target.embedding!r}, head={target.head!r}")
        try:
            a, b = model.get_parameter(target.embedding), model.get_parameter(target.head)
        except AttributeError as exc:
            raise AdapterError(spec, "TorchTarget names a parameter the model lacks",
                               got=str(exc)) from exc
        return _judged(check, target.embedding, target.head, a, b, "named by the TorchTarget")
    # 1. one Parameter under two names
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    shared = [ns for key, ns in names.items() if len(ns) >= 2 and params[key].dim() == 2]
    emb_name, emb_w = _module_weight_name(model, "get_input_embeddings")
    head_name, head_w = _module_weight_name(model, "get_output_embeddings")
    if shared:
        ns = next((n for n in shared if emb_name in n), shared[0])
        first = next((n for n in ns if _is_embedding_use(model, n)), ns[0])
        second = next(n for n in ns if n != first)
        return first, second, "one Parameter reachable under two names", passed(
            check, ONE_PARAMETER, f"{first} is {second}")
    # 2. the model's own accessors
    if emb_name and head_name and emb_w is not None and head_w is not None:
        how = "get_input_embeddings() / get_output_embeddings()"
        declared = _declared(model)
        if emb_w is head_w:
            return emb_name, head_name, how, passed(check, ONE_PARAMETER)
        if declared or _equal(emb_w, head_w):
            return _judged(check, emb_name, head_name, emb_w, head_w,
                           declared or "equal values at construction")
    # 3. an embedding and an output projection of the same shape holding equal values
    for a_name, b_name in _pairs(model):
        a, b = model.get_parameter(a_name), model.get_parameter(b_name)
        if _equal(a, b):
            return _judged(check, a_name, b_name, a, b, "equal values at construction")
    raise AdapterError(spec, "found no tie", expected="a Parameter used as both the token "
                       "embedding and the output head (reachable under two names, or "
                       "get_input_embeddings().weight is get_output_embeddings().weight), or a "
                       "TorchTarget(embedding=..., head=...)",
                       got="no shared Parameter, no declared tie and no embedding/projection "
                           "pair with equal values")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))


def _judged(check: str, emb: str, head: str, a: torch.Tensor, b: torch.Tensor,
            how: str) -> tuple[str, str, str, Finding]:
    if a is b:
        return emb, head, how, passed(check, ONE_PARAMETER, f"{emb} is {head}")
    same = "equal" if _equal(a, b) else "different"
    return emb, head, how, failed(
        check, ONE_PARAMETER, "tie_is_a_copy",
        f"{emb} and {head} are two Parameters ({same} values, storages "
        f"{a.data_ptr():#x} and {b.data_ptr():#x}) where a tie is expected ({how}): each "
        "use gets its own gradient and the optimizer steps two matrices")


def describe(spec: str, model: nn.Module, target: TorchTarget) -> tuple[Tie, Finding]:
    """The tie, the vocabulary, width, padding and batch shape a check of ``model`` uses."""
    emb, head, how, finding = find_tie(spec, model, target)
    weight = model.get_parameter(emb)
    V, d = int(weight.shape[0]), int(weight.shape[1])
    pad = getattr(owner(model, emb), "padding_idx", None)
    return Tie(emb, head, V, d, None if pad is None else int(pad), convention(model, target),
               max(1, target.batch_size), seq_len(model, target), how), finding


def seq_len(model: nn.Module, target: TorchTarget) -> int:
    if target.seq_len:
        return int(target.seq_len)
    # the context length, from transformers' and nanoGPT's configs or the model itself
    for source in (getattr(model, "config", None), model):
        for key in ("n_positions", "max_position_embeddings", "block_size", "n_ctx"):
            value = getattr(source, key, None)
            if isinstance(value, int) and value > 1:
                return min(value, MAX_SEQ_LEN)
    return MAX_SEQ_LEN


def convention(model: nn.Module, target: TorchTarget) -> str:
    if callable(target.loss):
        return "custom"
    if target.loss != "auto":
        return target.loss
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return "logits"
    if any(p.name == "labels" for p in params):
        return "labels"
    return "targets" if len(params) >= 2 else "logits"


def loss_function(target: TorchTarget, tie: Tie) -> Callable[[nn.Module, torch.Tensor,
                                                              torch.Tensor], torch.Tensor]:
    """``loss(model, tokens [B, T], targets [B, T]) -> scalar`` in the target's convention."""
    if callable(target.loss):
        custom = target.loss
        return lambda m, t, y: custom(m, t, y)

    def logits_of(out: Any) -> torch.Tensor:
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, (tuple, list)):
            logits = out[0]
        return out if logits is None else logits  # type: ignore[no-any-return]

    if tie.convention == "labels":
        # transformers' causal-LM loss: position i predicts labels[i + 1], mean over the
        # shifted positions.  Taken here from .logits rather than read from .loss, because
        # transformers computes .loss in float32 even for a float64 model (ForCausalLMLoss
        # upcasts with .float()), and the float64 checks need the float64 loss.
        def labels(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = logits_of(m(input_ids=t))
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   y[:, 1:].reshape(-1))
        return labels
    if tie.convention == "targets":
        def targets(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = m(t, y)
            if isinstance(out, (tuple, list)):
                return out[1]  # type: ignore[no-any-return]
            return getattr(out, "loss", out)  # type: ignore[no-any-return]
        return targets

    def plain(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = logits_of(m(t))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return plain
