"""A user's ``nn.Module`` as tyingspec sees it: where the tie is, how the loss is taken.

Runs where the user's code runs (the worker process); imports torch.  Discovery never edits
the model it inspects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.findings import Finding, failed, passed
from tyingspec._src.kinds.torch.batch import TorchBatch, model_device
from tyingspec._src.kinds.torch.tables import install as install_tables
from tyingspec._src.kinds.torch.tables import (
    lookup_tables,
    table_module,
    table_shape,
    tables,
    tables_of,
    unchanged_tables,
)
from tyingspec._src.kinds.torch.target import TorchTarget
from tyingspec._src.kinds.torch.uses import observed_uses

#: The invariant the discovery check guards.
ONE_PARAMETER = "the embedding and the head are one Parameter with one storage"

#: The sequence a check runs when the model declares no context length (no config key, no
#: position table): ``TorchTarget(seq_len=...)`` or ``--shape`` go further.  A model that
#: declares one is run at its whole context (within the check's budget, see
#: :mod:`kinds.torch.setting`).
MAX_SEQ_LEN = 256


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
    # every loss path the model has, the one ``convention`` names first (see loss_paths)
    paths: tuple[str, ...] = ()
    ids_keyword: bool = False  # the forward's first parameter is ``input_ids``: by keyword
    takes_mask: bool = False  # the forward takes ``attention_mask``
    # the ignore index the model's loss takes (probed: -100, else -1); None: none it takes
    ignore_index: int | None = None
    pad_token: int | None = None  # the pad token a config names, within the vocabulary
    context: int | None = None  # the context length the model declares, where it does
    # the forward's other required parameters named like targets, handed the targets too
    required_targets: tuple[str, ...] = ()


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
    # a tied table under a parametrization: its dL/dW is summed where W is made
    install_tables(model)
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
    path = next((name for name, m in model.named_modules(remove_duplicate=False)
                 if m is module), None)
    if not isinstance(weight, nn.Parameter):
        # a parametrized weight: the tie is named by the Parameter it is computed from
        table = next((t for t in tables(model) if path is not None and
                      t.module == path and t.attribute == "weight"), None)
        if table is None:
            return None, None
        return table.key, model.get_parameter(table.key)
    if path is not None:
        return (f"{path}.weight" if path else "weight"), weight
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
    shape elsewhere (an output projection).  A parametrized lookup is named by the Parameter
    its weight is computed from (weight norm's ``v`` holds the weight it was registered on,
    so a head that kept that weight pairs with it)."""
    emb = lookup_tables(model)
    out: list[tuple[str, str]] = []
    for name, w in emb:
        for other, p in model.named_parameters(remove_duplicate=False):
            if other != name and p is not w and p.dim() == 2 and p.shape == w.shape:
                out.append((name, other))
    return out


def _is_embedding_use(model: nn.Module, name: str) -> bool:
    return isinstance(owner(model, name), nn.Embedding)


def _reads_rows(model: nn.Module, name: str) -> bool:
    """Whether a lookup reads the Parameter ``name``: as its own weight, or through a
    parametrization of its weight (``name`` is then one of the parametrization's originals)."""
    return _is_embedding_use(model, name) or any(
        isinstance(model.get_submodule(t.module) if t.module else model, nn.Embedding)
        for t in tables_of(model, name) if name in t.originals)


def _computed_uses(model: nn.Module, names: list[str]) -> str | None:
    """Why one Parameter under ``names`` is no tie of one matrix: one use reads a
    parametrization of it and another the Parameter itself (a module parametrized after the
    tie was made), so the two uses consume two matrices.  None when every use reads the same
    kind of table."""
    computed = {n: [t for t in tables_of(model, n) if n in t.originals] for n in names}
    if not any(computed.values()) or all(computed.values()):
        return None
    table = next(t for ts in computed.values() for t in ts)
    raw = [n for n, ts in computed.items() if not ts]
    return (f"{table.name} is computed from the Parameter by {table.how}, while "
            f"{', '.join(raw)} reads the Parameter itself: the two uses consume two "
            "different matrices (a module parametrized after the tie was made); "
            f"parametrize both, or have the head read {table.name}")


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
        # a parametrized weight ("wte.weight") is named by the Parameter it is computed from
        named = {t.name: t.key for t in tables(model)}
        emb, head = (named.get(n, n) for n in (target.embedding, target.head))
        try:
            a, b = model.get_parameter(emb), model.get_parameter(head)
        except AttributeError as exc:
            raise AdapterError(spec, "TorchTarget names a parameter the model lacks",
                               got=str(exc)) from exc
        return _judged(check, emb, head, a, b, "named by the TorchTarget")
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
              and any(_reads_rows(model, n) for n in ns)]
    if shared:
        ns = next((n for n in shared if emb_name in n), shared[0])
        first = next(n for n in ns if _reads_rows(model, n))
        # the head: a name whose module is no lookup (Bart: shared, encoder.embed_tokens,
        # decoder.embed_tokens and lm_head are four names of one Parameter)
        second = next((n for n in ns if n != first and not _reads_rows(model, n)),
                      next(n for n in ns if n != first))
        how = f"one Parameter reachable under {len(ns)} names"
        two = _computed_uses(model, ns)
        if two is not None:
            return first, second, how, failed(check, ONE_PARAMETER, "tie_lost",
                                              f"{' is '.join(ns)}, but {two}")
        return first, second, how, passed(check, ONE_PARAMETER, " is ".join(ns))
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
    if a.dim() == b.dim() == 2 and a.shape[0] != b.shape[0]:
        return emb, head, how, failed(
            check, ONE_PARAMETER, "tie_lost",
            f"{emb} holds {a.shape[0]} rows and {head} {b.shape[0]}: the two uses no longer "
            f"share a vocabulary where a tie is declared ({how}): a resize "
            "(resize_token_embeddings) replaced one of them and nothing re-tied them; the "
            f"check runs on the {min(a.shape[0], b.shape[0])} tokens both hold")
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


def _computed_note(model: nn.Module, emb: str, finding: Finding) -> Finding:
    """The discovery finding, saying where a parametrized table is judged."""
    found = tables_of(model, emb)
    if not found:
        return finding
    names = " and ".join(dict.fromkeys(t.name for t in found))
    note = (f"the uses read {names}, computed from {', '.join(found[0].originals)} by "
            f"{found[0].how}: the tied gradient is judged at the parametrized weight (dL/dW, "
            "summed over the uses), before the parametrization's own backward")
    return replace(finding, detail=f"{finding.detail}; {note}" if finding.detail else note)


def _vocabulary(model: nn.Module, emb: str, head: str) -> tuple[int, int]:
    """The vocabulary and width a check runs at: the table's (a parametrized table's is the
    shape of the tensor its uses read); where the tie is lost and the two uses hold different
    vocabularies (a resize that replaced one of them), the tokens both hold, so that the model
    runs and the lost tie is what the check reports."""
    V, d = (int(n) for n in table_shape(model, emb)[:2])
    if head != emb:
        rows = table_shape(model, head)
        if len(rows) == 2 and rows[1] == d:
            V = min(V, int(rows[0]))
    return V, d


def _leaves_the_model_as_found(
        describe: Callable[[str, nn.Module, TorchTarget], tuple[Tie, Finding]]
) -> Callable[[str, nn.Module, TorchTarget], tuple[Tie, Finding]]:
    """``describe`` whose probe forwards leave no trace on the model (see
    :func:`kinds.torch.tables.unchanged_tables`: ``nn.Embedding(max_norm=...)``)."""
    def described(spec: str, model: nn.Module, target: TorchTarget) -> tuple[Tie, Finding]:
        with unchanged_tables(model):
            return describe(spec, model, target)
    described.__doc__ = describe.__doc__
    return described


@_leaves_the_model_as_found
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
    finding = _computed_note(model, emb, finding)
    V, d = _vocabulary(model, emb, head)
    lookup = table_module(model, emb)  # the module reading the table: its options are the tie's
    pad = getattr(lookup, "padding_idx", None)
    tie = replace(_called(model, target, emb, V, d), embedding=emb, head=head,
                  padding_idx=None if pad is None else int(pad), how=how,
                  scale_grad_by_freq=bool(getattr(lookup, "scale_grad_by_freq", False)))
    tie = replace(tie, seq_len=_fitting_seq_len(model, target, tie))
    return replace(tie, paths=loss_paths(model, target, tie),
                   ignore_index=_ignore_index(model, target, tie)), finding


def _called(model: nn.Module, target: TorchTarget, emb: str, V: int, d: int) -> Tie:
    """How the model is called: its convention and the parameters its forward takes."""
    conv, param, keyword = convention(model, target)
    params = _forward_parameters(model) or []
    names = [p.name for p in params]
    required = tuple(p.name for p in params if p.default is p.empty and p.name in _TARGET_NAMES
                     and p.kind != p.KEYWORD_ONLY)
    return Tie(emb, emb, V, d, None, conv, max(1, target.batch_size or 2),
               seq_len(model, target, emb), "", targets_param=param, targets_keyword=keyword,
               no_cache="use_cache" in names, paths=(conv,),
               ids_keyword=bool(names) and names[0] == "input_ids",
               takes_mask="attention_mask" in names, pad_token=_pad_token(model, V),
               context=_declared_context(model, emb), required_targets=required)


def _declared_context(model: nn.Module, embedding: str) -> int | None:
    """The context the model declares: its config's, capped by its position tables (None
    where it declares neither)."""
    limits = _position_tables(model, embedding)
    context = _context(model)
    if context is not None:
        limits.append(context)
    return max(2, min(limits)) if limits else None


def _pad_token(model: nn.Module, vocab: int) -> int | None:
    config = getattr(model, "config", None)
    sources: list[Any] = [config] if config is not None else []
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            sources.insert(0, text())
        except Exception:  # noqa: BLE001 - a config's own helper; the top config still counts
            pass
    found = next(declared_ints([s for s in sources if s is not None], ("pad_token_id",)), None)
    return found if found is not None and 0 <= found < vocab else None


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
                run(model, TorchBatch(ids, ids))
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
    candidates = lookup_tables(model)  # a parametrized one by the Parameter it is made from
    for name, weight in candidates:
        called = _called(model, target, name, int(weight.shape[0]), int(weight.shape[1]))
        probe = replace(called, batch_size=1, seq_len=min(8, called.seq_len))
        ids = torch.arange(probe.seq_len).reshape(1, -1) % probe.vocab
        try:
            with observed_uses(weight) as uses:
                loss_function(target, probe)(model, TorchBatch(ids, ids))
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
    """The positions of one sequence: the target's own, else the model's context length and
    never past its shortest position table (:data:`MAX_SEQ_LEN` where neither is declared).
    The check's budget may run fewer (see :mod:`kinds.torch.setting`)."""
    if target.seq_len:
        return int(target.seq_len)
    limits = _position_tables(model, embedding)
    context = _context(model)
    if context is not None:
        limits.append(context)
    return max(2, min(limits)) if limits else MAX_SEQ_LEN


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


def forward(m: nn.Module, tie: Tie, path: str, batch: TorchBatch) -> Any:
    """The model's forward on ``batch`` along loss path ``path`` (``labels``: transformers'
    ``labels=``; ``targets``: its targets argument; ``logits``: no targets at all).  Only
    parameters the forward takes are handed over; a required parameter named like targets
    that the path does not use gets the targets too (``forward(idx, targets, labels)``)."""
    batch = batch.to(model_device(m))  # built on the CPU, handed where the model is
    kwargs: dict[str, Any] = {"use_cache": False} if tie.no_cache else {}
    if tie.takes_mask and batch.mask is not None:
        kwargs["attention_mask"] = batch.mask
    args: list[Any] = []
    if tie.ids_keyword:
        kwargs["input_ids"] = batch.tokens
    else:
        args.append(batch.tokens)
    y = batch.targets
    if path == "labels":
        kwargs["labels"] = y
    elif path == "targets":
        name = tie.targets_param or "targets"
        if tie.targets_keyword or tie.ids_keyword or kwargs:
            kwargs[name] = y
        else:
            args.append(y)
    for name in tie.required_targets:
        if name not in kwargs and not (path == "targets" and len(args) == 2):
            kwargs[name] = y
    return m(*args, **kwargs)


def _scalar_loss(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0), out[-1])
    loss = getattr(out, "loss", None)
    return out if loss is None else loss  # type: ignore[no-any-return]


def cross_entropy(logits: torch.Tensor, batch: TorchBatch) -> torch.Tensor:
    """tyingspec's own loss of a model's logits: the mean cross-entropy over the targets that
    are not ignored (float32 for a low-precision model, as transformers' loss upcasts)."""
    z = logits.reshape(-1, logits.shape[-1])
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    return F.cross_entropy(z, batch.targets.reshape(-1).to(z.device),
                           ignore_index=batch.ignore_index)


Loss = Callable[[nn.Module, TorchBatch], torch.Tensor]


def loss_function(target: TorchTarget, tie: Tie, path: str | None = None) -> Loss:
    """``loss(model, batch) -> scalar``: the loss the model trains with along ``path`` (the
    target's convention by default).  A model with its own loss (``labels=``, ``targets``) is
    judged on it: a wrong normalisation is part of what is checked.  A ``TorchTarget(loss=)``
    callable is handed the user's model, the tokens and the targets."""
    if callable(target.loss):
        custom = target.loss
        def handed(m: nn.Module, b: TorchBatch) -> torch.Tensor:
            on = b.to(model_device(m))
            return custom(m, on.tokens, on.targets)  # type: ignore[no-any-return]
        return handed
    path = path or tie.convention
    if path in ("labels", "targets"):
        # transformers: the model shifts the labels itself (causal LM), reads them unshifted
        # (masked LM), or builds decoder inputs by shifting them right (encoder-decoder), and
        # returns the loss it trains with
        return lambda m, b: _scalar_loss(forward(m, tie, path, b))
    return lambda m, b: cross_entropy(_logits_of(forward(m, tie, "logits", b)), b)


def loss_paths(model: nn.Module, target: TorchTarget, tie: Tie) -> tuple[str, ...]:
    """Every loss path the model has, its convention's first: ``labels=`` where the forward
    takes ``labels``, its targets argument where it takes one, and its logits where a forward
    with neither returns ``[B, T, V]`` (transformers' Trainer takes the first, a hand-written
    loop often the last; a bug on either one is a bug).  A target that names its convention or
    its loss has that one path."""
    if callable(target.loss) or target.loss != "auto":
        return (tie.convention,)
    found = [tie.convention]
    params = _forward_parameters(model) or []
    if tie.convention != "labels" and any(p.name == "labels" for p in params):
        found.append("labels")
    if tie.convention != "targets" and tie.targets_param and tie.targets_param != "labels":
        found.append("targets")
    if tie.convention != "logits" and not tie.required_targets:
        ids = (torch.arange(4 * 2) % tie.vocab).reshape(2, 4)
        try:
            with torch.no_grad():
                logits = _logits_of(forward(model, tie, "logits", TorchBatch(ids, ids)))
            if isinstance(logits, torch.Tensor) and tuple(logits.shape) == (2, 4, tie.vocab):
                found.append("logits")
        except Exception:  # noqa: BLE001  (a forward that needs its targets has no such path)
            pass
    return tuple(found)


def _ignore_index(model: nn.Module, target: TorchTarget, tie: Tie) -> int | None:
    """The ignored target the model's loss takes: -100 (torch's and transformers' default),
    else -1 (nanoGPT's); None when neither runs (a loss that indexes with every target)."""
    n = min(4, tie.seq_len)
    ids = (torch.arange(2 * n) % tie.vocab).reshape(2, n)
    run = loss_function(target, tie)
    for ignore in (-100, -1):
        y = ids.clone()
        # every position but the first: a model that feeds its labels back in (an
        # encoder-decoder shifting them into decoder inputs) must take the ignore index there
        y[1, 1:] = ignore
        try:
            with torch.no_grad():
                value = run(model, TorchBatch(ids, y, ignore_index=ignore))
        except Exception:  # noqa: BLE001  (this ignore index is one the loss cannot take)
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 0 and \
                bool(torch.isfinite(value)):
            return ignore
    return None
