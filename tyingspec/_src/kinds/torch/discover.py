"""A user's ``nn.Module`` as tyingspec sees it: where the tie is, how the loss is taken.

Runs where the user's code runs (the worker process); imports torch.  Discovery never edits
the model it inspects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.kinds.torch.target import TorchTarget

#: The invariant the discovery check guards.
ONE_PARAMETER = "the embedding and the head are one Parameter with one storage"

#: The longest sequence a check runs by default (a model's context may be thousands of
#: positions; ``TorchTarget(seq_len=...)`` or ``--shape`` go further).  Long enough to pass the
#: chunk boundaries of chunked lookups and losses (16, 32, 64 positions).
MAX_SEQ_LEN = 128


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
    targets_param: str | None = None  # the forward's targets parameter ("targets", "labels")
    targets_keyword: bool = False  # passed by keyword (a keyword-only parameter)
    no_cache: bool = False  # forward takes use_cache: passed False (RWKV needs it)
    scale_grad_by_freq: bool = False  # the embedding divides by each token's count per call


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
    """The parameter name of ``model.get_input_embeddings().weight`` (or output), spelled
    through the module the accessor returns (a tied Parameter has several names, and the
    head's is the one under the head module)."""
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
    for name, m in model.named_modules(remove_duplicate=False):
        if m is module:
            return (f"{name}.weight" if name else "weight"), weight
    return _name_of(model, weight), weight


def _declared(model: nn.Module) -> str | None:
    """Where the model instance declares a tie it should have.

    transformers sets ``_tied_weights_keys`` on the *class* whatever the config says, so the
    class attribute alone declares nothing for a transformers model: the instance's
    ``all_tied_weights_keys`` (empty when ``tie_word_embeddings=False``) and the config flag
    decide.  A model without a config may still declare ``_tied_weights_keys`` itself."""
    config = getattr(model, "config", None)
    flag = getattr(config, "tie_word_embeddings", None)
    keys = getattr(model, "all_tied_weights_keys", None)
    if flag is False:
        return None
    if keys is not None and not callable(keys):
        try:
            return f"all_tied_weights_keys = {dict(keys)!r}" if len(keys) else None
        except TypeError:
            pass
    if flag is True:
        return "config.tie_word_embeddings is True"
    if config is None:
        own = getattr(model, "_tied_weights_keys", None)
        if own:
            return f"_tied_weights_keys = {own!r}"
    return None


def _no_tie_reason(model: nn.Module) -> str:
    """Why a model has no tie, in the words of its own config where it has one."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", None) is False:
        return "config.tie_word_embeddings=False"
    return ("no shared Parameter, no declared tie and no embedding/projection pair with equal "
            "values")


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
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    emb_name, emb_w = _module_weight_name(model, "get_input_embeddings")
    head_name, head_w = _module_weight_name(model, "get_output_embeddings")
    # 1. the model's own accessors (transformers): one Parameter, or two where one is declared
    if emb_name and head_name and emb_w is not None and head_w is not None:
        how = "get_input_embeddings() / get_output_embeddings()"
        if emb_w is head_w:
            ns = names.get(id(emb_w), [emb_name, head_name])
            return emb_name, head_name, how, passed(check, ONE_PARAMETER, " is ".join(ns))
        declared = _declared(model)
        if declared or _equal(emb_w, head_w):
            return _judged(check, emb_name, head_name, emb_w, head_w,
                           declared or "equal values at construction")
    # 2. one Parameter under two names, one of them a lookup's
    shared = [ns for key, ns in names.items() if len(ns) >= 2 and params[key].dim() == 2
              and any(_is_embedding_use(model, n) for n in ns)]
    if shared:
        ns = next((n for n in shared if emb_name in n), shared[0])
        first = next(n for n in ns if _is_embedding_use(model, n))
        # the head: a name whose module is no lookup (Bart: shared, encoder.embed_tokens,
        # decoder.embed_tokens and lm_head are four names of one Parameter)
        second = next((n for n in ns if n != first and not _is_embedding_use(model, n)),
                      next(n for n in ns if n != first))
        return first, second, f"one Parameter reachable under {len(ns)} names", passed(
            check, ONE_PARAMETER, " is ".join(ns))
    # 3. an embedding and an output projection of the same shape holding equal values
    for a_name, b_name in _pairs(model):
        a, b = model.get_parameter(a_name), model.get_parameter(b_name)
        if _equal(a, b):
            return _judged(check, a_name, b_name, a, b, "equal values at construction")
    raise AdapterError(spec, f"found no tie ({_no_tie_reason(model)})",
                       expected="a Parameter used as both the token "
                       "embedding and the output head (reachable under two names, or "
                       "get_input_embeddings().weight is get_output_embeddings().weight), or a "
                       "TorchTarget(embedding=..., head=...)",
                       got=_no_tie_reason(model))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _judged(check: str, emb: str, head: str, a: torch.Tensor, b: torch.Tensor,
            how: str) -> tuple[str, str, str, Finding]:
    """One Parameter: passed.  Two where a tie is expected: over one storage, the tie was
    lost by a load that rebinds each name (``load_state_dict(assign=True)``); with different
    values, by a transformation that replaced one of them (meta-device init + ``to_empty()``,
    a resize, a load into separate tensors); with equal values over two storages, the head was
    made a copy (``nn.Parameter(weight.clone())``)."""
    if a is b:
        return emb, head, how, passed(check, ONE_PARAMETER, f"{emb} is {head}")
    if a.shape == b.shape and _storage(a) == _storage(b):
        return emb, head, how, failed(
            check, ONE_PARAMETER, "tie_lost",
            f"{emb} and {head} are two Parameters over one storage ({_storage(a):#x}) where "
            f"a tie is expected ({how}): what load_state_dict(assign=True) leaves; each gets "
            "only its own path's gradient and an optimizer keeps two states for one matrix")
    if not _equal(a, b):
        return emb, head, how, failed(
            check, ONE_PARAMETER, "tie_lost",
            f"{emb} and {head} are two Parameters with different values (storages "
            f"{_storage(a):#x} and {_storage(b):#x}) where a tie is declared ({how}): a "
            "transformation after construction replaced one of them (meta-device init + "
            "to_empty(), a vocabulary resize, a load into separate tensors) and nothing "
            "re-tied them")
    return emb, head, how, failed(
        check, ONE_PARAMETER, "tie_is_a_copy",
        f"{emb} and {head} are two Parameters (equal values, storages "
        f"{_storage(a):#x} and {_storage(b):#x}) where a tie is expected ({how}): each "
        "use gets its own gradient and the optimizer steps two matrices")


def describe(spec: str, model: nn.Module, target: TorchTarget) -> tuple[Tie, Finding]:
    """The tie, the vocabulary, width, padding and batch shape a check of ``model`` uses."""
    try:
        emb, head, how, finding = find_tie(spec, model, target)
    except AdapterError:
        found = _tie_by_uses(model, target)
        if found is None:
            raise
        emb = head = found
        how = "one Parameter read by a lookup and used by a head in one forward"
        finding = passed("tie discovered", ONE_PARAMETER, f"{found}: {how}")
    weight = model.get_parameter(emb)
    V, d = int(weight.shape[0]), int(weight.shape[1])
    pad = getattr(owner(model, emb), "padding_idx", None)
    conv, param, keyword = convention(model, target)
    tie = Tie(emb, head, V, d, None if pad is None else int(pad), conv,
              max(1, target.batch_size), seq_len(model, target, emb), how,
              targets_param=param, targets_keyword=keyword,
              no_cache=_accepts(model, "use_cache"),
              scale_grad_by_freq=bool(getattr(owner(model, emb), "scale_grad_by_freq",
                                              False)))
    return replace(tie, seq_len=_fitting_seq_len(model, target, tie)), finding


#: Positions :func:`_fitting_seq_len` gives up, one at a time, before it leaves the length as
#: it was (and the check reports the forward's error as it would have).
_FIT_STEPS = 4


def _fitting_seq_len(model: nn.Module, target: TorchTarget, tie: Tie) -> int:
    """``tie.seq_len``, or fewer positions where a position table that counts from its
    ``padding_idx`` holds fewer than that rule allows.  RoBERTa reads positions padding_idx + 1
    on, which :func:`_position_tables` allows for; transformers' ProphetNet reads one more (its
    predicting stream is at position + 1), so its forward raises an IndexError at the last
    length the rule allows (a sweep of transformers 5.25's causal-LM architectures: exit 2 on a
    correct model).  Only models with such a table pay a forward here (without gradients), and
    only an IndexError makes the length shorter: any other error is the check's to report."""
    if target.seq_len or not any(m.padding_idx is not None for m in _position_modules(
            model, tie.embedding)):
        return tie.seq_len
    run = loss_function(target, tie)
    for n in range(tie.seq_len, max(1, tie.seq_len - _FIT_STEPS), -1):
        ids = torch.arange(n).reshape(1, -1) % tie.vocab
        try:
            with torch.no_grad():
                run(model, ids, ids)
        except IndexError:
            continue
        except Exception:  # noqa: BLE001 - not a length the model cannot index: reported later
            return tie.seq_len
        return n
    return tie.seq_len


def _tie_by_uses(model: nn.Module, target: TorchTarget) -> str | None:
    """The name of an embedding's weight that one forward both looks up and scores with (a
    functional head, ``logits = x @ wte.weight.T``, or torchtune's ``TiedLinear``, which hold
    the Parameter under one name); None when no weight is used both ways."""
    from tyingspec._src.kinds.torch.uses import observed_uses

    candidates = [(f"{m}.weight" if m else "weight", mod.weight)
                  for m, mod in model.named_modules() if isinstance(mod, nn.Embedding)]
    conv, param, keyword = convention(model, target)
    for name, weight in candidates:
        probe = Tie(name, name, int(weight.shape[0]), int(weight.shape[1]), None, conv, 1,
                    min(8, seq_len(model, target, name)), "", targets_param=param,
                    targets_keyword=keyword, no_cache=_accepts(model, "use_cache"))
        ids = torch.arange(probe.seq_len).reshape(1, -1) % probe.vocab
        try:
            with observed_uses(weight) as uses:
                loss_function(target, probe)(model, ids, ids)
        except Exception:  # noqa: BLE001  (this candidate's forward failed: not this one)
            continue
        if uses.lookups and uses.heads:
            return name
    return None


#: Where models keep their context length: transformers' and nanoGPT's configs, from-scratch
#: loaders' config dicts (``cfg["context_length"]``), torchtune's ``max_seq_len``.
_CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "block_size", "n_ctx",
                 "context_length", "max_seq_len", "max_seq_length", "seq_len", "ctx_len")


def model_sources(model: nn.Module, configs: Sequence[Any]) -> list[Any]:
    """Where a model says what it is: ``configs``, the model itself, and the config dicts it
    holds (LLMs-from-scratch keeps ``cfg`` as a plain dict)."""
    return [*configs, model, *(v for v in vars(model).values() if isinstance(v, dict))]


def declared_ints(sources: Sequence[Any], keys: Sequence[str]) -> Iterator[int]:
    """The integers ``sources`` (objects or dicts) hold under ``keys``, source by source and
    key by key (a bool is no integer here)."""
    for source in sources:
        for key in keys:
            value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                yield value


def _context(model: nn.Module) -> int | None:
    sources = model_sources(model, [getattr(model, "config", None)])
    return next((v for v in declared_ints(sources, _CONTEXT_KEYS) if v > 1), None)


def _position_modules(model: nn.Module, embedding: str) -> list[nn.Embedding]:
    """The model's learned position tables: an Embedding named like one, not the tied one."""
    tied = embedding.rpartition(".")[0]
    return [m for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) and name != tied and
            ("pos" in name.lower() or name.rpartition(".")[2] == "wpe")]


def _position_tables(model: nn.Module, embedding: str) -> list[int]:
    """The sizes of the model's learned position tables: a sequence longer than the shortest
    would index past it."""
    # RoBERTa counts positions from padding_idx + 1: its table holds that many fewer
    return [int(m.num_embeddings) - (0 if m.padding_idx is None else int(m.padding_idx) + 1)
            for m in _position_modules(model, embedding)]


def seq_len(model: nn.Module, target: TorchTarget, embedding: str = "") -> int:
    """The positions of one sequence: the target's own, else the model's context length
    (at most ``MAX_SEQ_LEN``) and never past its shortest position table."""
    if target.seq_len:
        return int(target.seq_len)
    limits = [MAX_SEQ_LEN, *_position_tables(model, embedding)]
    context = _context(model)
    if context is not None:
        limits.append(context)
    return max(2, min(limits))


#: Names a forward's targets parameter goes by (nanoGPT ``targets``, minGPT ``targets``,
#: LLMs-from-scratch ``target``, x-transformers ``labels``): a second parameter that is not
#: one of these (a ``return_embeddings`` flag, a mask) is never handed the targets.
_TARGET_NAMES = ("targets", "target", "labels", "label", "y", "tgt", "target_ids")


def _forward_parameters(model: nn.Module) -> list[inspect.Parameter] | None:
    try:
        return [p for p in inspect.signature(model.forward).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return None


def _accepts(model: nn.Module, name: str) -> bool:
    params = _forward_parameters(model)
    return params is not None and any(p.name == name for p in params)


def convention(model: nn.Module, target: TorchTarget) -> tuple[str, str | None, bool]:
    """The loss convention, the name of the forward's targets parameter and whether it is
    passed by keyword (keyword-only parameters are never taken positionally)."""
    if callable(target.loss):
        return "custom", None, False
    params = _forward_parameters(model)
    named = next((p for p in params or () if p.name in _TARGET_NAMES and p.name != "labels"),
                 None)
    if target.loss != "auto":
        keyword = named is not None and named.kind == named.KEYWORD_ONLY
        return target.loss, None if named is None else named.name, keyword
    if params is None:
        return "logits", None, False
    if any(p.name == "labels" for p in params):
        return "labels", "labels", True
    if named is not None:
        return "targets", named.name, named.kind == named.KEYWORD_ONLY
    return "logits", None, False


def _logits_of(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    return out if logits is None else logits  # type: ignore[no-any-return]


def loss_function(target: TorchTarget, tie: Tie) -> Callable[[nn.Module, torch.Tensor,
                                                              torch.Tensor], torch.Tensor]:
    """``loss(model, tokens [B, T], targets [B, T]) -> scalar``: the loss the model trains
    with, in the target's convention.  A model with its own loss (``labels=``, ``targets``)
    is judged on it: a wrong normalisation is part of what is checked."""
    if callable(target.loss):
        custom = target.loss
        return lambda m, t, y: custom(m, t, y)
    extra: dict[str, Any] = {"use_cache": False} if tie.no_cache else {}

    if tie.convention == "labels":
        # transformers: the model shifts the labels itself (causal LM), reads them unshifted
        # (masked LM), or builds decoder inputs by shifting them right (encoder-decoder), and
        # returns the loss it trains with
        def labels(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = m(input_ids=t, labels=y, **extra)
            loss = getattr(out, "loss", None)
            if loss is None and isinstance(out, (tuple, list)):
                loss = out[0]
            return cast(torch.Tensor, loss)
        return labels
    if tie.convention == "targets":
        name, keyword = tie.targets_param or "targets", tie.targets_keyword

        def targets(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = m(t, **{name: y}, **extra) if keyword else m(t, y, **extra)
            if isinstance(out, (tuple, list)):
                return next((o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0),
                            out[-1])
            return getattr(out, "loss", out)  # type: ignore[no-any-return]
        return targets

    def plain(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = _logits_of(m(t, **extra))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float()
                               if logits.dtype in (torch.float16, torch.bfloat16) else
                               logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return plain
