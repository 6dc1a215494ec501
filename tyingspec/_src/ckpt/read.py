"""Reading a checkpoint as one state dict, and finding its tied pairs (the embedding and its
head first).

Files are read only through ``safetensors`` and ``torch.load(weights_only=True)``: nothing
else is ever unpickled, and a format neither reads (GGUF) is named by its magic bytes.  A
sharded checkpoint (an index JSON with a ``weight_map``) is read as one.  The pairs are the
ties transformers' classes declare (:mod:`ckpt.pairs`), else the names real models use; a file
whose names cannot be paired is a :class:`CkptError`, never read as tied.  The file is
untrusted input: whatever its parser raises (torch's zip reader, the weights-only unpickler,
the JSON reader) becomes a :class:`CkptError` line, never a traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import pickle
import re
import stat
import sys
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.files import (
    absolute,
)

if TYPE_CHECKING:
    import torch

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2

# The names real models give the token embedding and the output projection.  The embedding is
# searched first; the head is taken from the same family when both are present.
EMBEDDING_KEYS = ("transformer.wte.weight", "model.embed_tokens.weight", "tok_embeddings.weight",
                  "gpt_neox.embed_in.weight", "model.decoder.embed_tokens.weight",
                  "model.language_model.embed_tokens.weight", "transformer.word_embeddings.weight",
                  "embeddings.word_embeddings.weight", "embed_tokens.weight", "wte.weight",
                  "token_embd.weight")  # the last: llama.cpp's GGUF names (convert_hf_to_gguf)
HEAD_KEYS = ("lm_head.weight", "output.weight", "embed_out.weight")
# torch.compile and DistributedDataParallel prefix every key of a saved state dict
_PREFIXES = ("", "_orig_mod.", "module.")
SAFETENSORS_EXT = (".safetensors",)
TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")
POLICIES = ("input", "output", "average", "refuse")
# how deep "model"/"state_dict"/"module" wrappers of a torch file are unwrapped (nanoGPT and
# Lightning use one); a file nesting deeper, or nesting a dict in itself, is not a checkpoint
_MAX_WRAPPERS = 8


class CkptError(TyingspecError):
    """Bad input: the message names the file, the key and what was expected and found."""


@dataclass
class Checkpoint:
    """A checkpoint read as one state dict (every shard merged)."""

    path: str
    format: str  # "safetensors" or "torch"
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


# --- reading ---------------------------------------------------------------------------------

def _format_of(path: str) -> str:
    if path.endswith(SAFETENSORS_EXT):
        return "safetensors"
    if path.endswith(TORCH_EXT):
        return "torch"
    # unknown extension: trust the content (a safetensors file starts with an 8-byte header
    # length and then "{"), never a guess that would unpickle
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError as exc:
        raise CkptError(f"{path}: cannot be read ({exc.strerror})") from exc
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"


def first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception from a parser, short enough for one error line."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    # torch's reader appends advice to every error ("This is an internal miniz error...")
    line = line.split(" This is an internal miniz error")[0]
    line = line if len(line) <= 200 else line[:197] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _load_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = fh.get_tensor(key)
    except Exception as exc:  # the file is untrusted input: whatever its parser raises
        raise CkptError(f"{path}: not a readable safetensors file (truncated or corrupt?): "
                        f"{first_line(exc)}") from exc
    return tensors, metadata


def _state_dict_from(obj: Any, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import torch

    # nanoGPT's ckpt.pt and Lightning wrap the state dict: {"model": ..., "optimizer": ...}.
    # Unwrapped in a loop, never recursively: a pickle can nest a dict thousands deep, or in
    # itself, and either would otherwise end in a RecursionError
    seen: set[int] = set()
    where = ""
    while isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        inner = next((k for k in ("model", "state_dict", "module") if isinstance(obj.get(k),
                                                                                dict)), None)
        if inner is None:
            break
        if id(obj) in seen:
            raise CkptError(f"{path}: the object under {where or 'the top level'} contains "
                            f"itself (a self-referencing dict), not a state dict")
        if len(seen) >= _MAX_WRAPPERS:
            raise CkptError(f"{path}: expected a state dict within {_MAX_WRAPPERS} wrappers "
                            f"(\"model\", \"state_dict\", \"module\"), found them nested "
                            f"deeper ({where}...)")
        seen.add(id(obj))
        where += f"[{inner!r}]"
        obj = obj[inner]
    if not isinstance(obj, dict) or not obj:
        raise CkptError(f"{path}: expected a state dict (a mapping of names to tensors), got "
                        f"{type(obj).__name__}" + (f" under {where}" if where else "")
                        + (" (empty)" if isinstance(obj, dict) else ""))
    named = [k for k in obj if not isinstance(k, str)]
    if named:
        raise CkptError(f"{path}: expected string keys in the state dict, key {named[0]!r} is "
                        f"{type(named[0]).__name__}")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CkptError(f"{path}: expected a tensor under every key, key {bad[0]!r} holds "
                        f"{type(obj[bad[0]]).__name__}")
    meta: dict[str, str] = {}
    saved = getattr(obj, "_metadata", None)
    if isinstance(saved, dict) and isinstance(saved.get(""), dict):
        meta = {k: str(v) for k, v in saved[""].items() if str(k).startswith("tyingspec.")}
    return dict(obj), meta


def _load_torch(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message opens with advice to re-run with weights_only=False (the one thing
        # never to do with an untrusted file), in ANSI bold; the reason follows it
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
        _, marker, reason = text.partition("WeightsUnpickler error:")
        lines = [ln.strip() for ln in (reason if marker else text).splitlines() if ln.strip()]
        first = lines[0].split(". Please use")[0] if lines else type(exc).__name__
        raise CkptError(f"{path}: refused by torch.load(weights_only=True), which only loads "
                        f"tensors and plain containers; tyingspec never unpickles anything "
                        f"else ({first})") from exc
    except Exception as exc:
        # the file is untrusted input: a corrupt zip is torch's RuntimeError (inline_container),
        # a corrupt pickle inside it the weights-only unpickler's IndexError (an empty stack),
        # KeyError (a memo entry never stored) or UnicodeDecodeError
        raise CkptError(f"{path}: not a readable torch file (truncated or corrupt?): "
                        f"{first_line(exc)}") from exc
    return _state_dict_from(obj, path)


def _regular_file(path: str, what: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise CkptError(f"{what}{path}: no such file") from exc
    except OSError as exc:  # a symlink loop, a permission
        raise CkptError(f"{what}{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, pipe or socket"
        raise CkptError(f"{what}{path}: expected a regular file, got {kind}")


#: the magic bytes a format opens with, for the formats tyingspec does not read: named, rather
#: than handed to torch.load (whose refusal speaks of pickles and weights_only)
FOREIGN_MAGIC = ((b"GGUF", "a GGUF file (llama.cpp's format, magic bytes 'GGUF')"),)


def _refuse_foreign(path: str) -> None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as exc:
        raise CkptError(f"{path}: cannot be read ({exc.strerror})") from exc
    for magic, what in FOREIGN_MAGIC:
        if head.startswith(magic):
            raise CkptError(f"{path}: {what}: tyingspec ckpt reads safetensors and torch files "
                            f"only, not GGUF; inspect the safetensors or torch checkpoint it "
                            f"was converted from")


def _load_one(path: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    _regular_file(path, "")
    _refuse_foreign(path)
    fmt = _format_of(path)
    tensors, meta = _load_safetensors(path) if fmt == "safetensors" else _load_torch(path)
    return fmt, tensors, meta


def load(path: str) -> Checkpoint:
    """Read a safetensors file, a torch file (``weights_only=True``) or a sharded index JSON."""
    if not path.endswith(".json"):
        fmt, tensors, meta = _load_one(path)
        return Checkpoint(path, fmt, tensors, meta, [path])
    index = _read_json(path, "a JSON index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CkptError(f"{path}: expected a sharded-checkpoint index with a non-empty "
                        "\"weight_map\" {key: file}")
    odd = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if odd is not None:
        raise CkptError(f"{path}: expected a file name for every key of \"weight_map\", key "
                        f"{odd[0]!r} maps to {odd[1]!r}")
    base = os.path.dirname(path)
    merged: dict[str, torch.Tensor] = {}
    formats: set[str] = set()
    files: list[str] = []
    merged_meta: dict[str, str] = {}
    for shard in sorted(set(map(str, weight_map.values()))):
        shard_path = os.path.join(base, shard)
        if shard.endswith(".json") or same_file(shard_path, path):
            raise CkptError(f"{path}: the weight_map names {shard!r} as a shard; expected "
                            f".safetensors or torch files, not an index (the index would "
                            f"read itself)")
        fmt, tensors, shard_meta = _load_one(shard_path)
        formats.add(fmt)
        files.append(shard_path)
        merged_meta.update(shard_meta)
        for key in tensors:
            if key in merged:
                raise CkptError(f"{shard_path}: key {key!r} is also in another shard")
        merged.update(tensors)
    for key, shard in weight_map.items():
        if key not in merged:
            raise CkptError(f"{os.path.join(base, str(shard))}: missing key {key!r} that the "
                            f"index {path} places there")
    return Checkpoint(path, formats.pop() if len(formats) == 1 else "mixed", merged, merged_meta,
                      files)


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise CkptError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise CkptError(f"{path}: not {what}: expected UTF-8 text, byte "
                        f"{exc.object[exc.start:exc.start + 1]!r} at offset {exc.start} is "
                        f"not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise CkptError(f"{path}: not {what} ({exc})") from exc
    except RecursionError as exc:
        raise CkptError(f"{path}: not {what}: nested deeper than the JSON reader allows "
                        f"(about {sys.getrecursionlimit()} levels)") from exc
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise CkptError(f"{path}: not {what} ({first_line(exc)})") from exc


def read_config(path: str) -> dict[str, Any]:
    config = _read_json(path, "a JSON config")
    if not isinstance(config, dict):
        raise CkptError(f"{path}: expected a JSON object, got {type(config).__name__}")
    for where, obj in (("", config), ("text_config.", config.get("text_config"))):
        if where and obj is not None and not isinstance(obj, dict):
            raise CkptError(f"{path}: expected \"text_config\" to be a JSON object, got "
                            f"{type(obj).__name__}")
        value = obj.get("tie_word_embeddings") if isinstance(obj, dict) else None
        if value is not None and not isinstance(value, bool):
            # bool("false") is True: a string or a number here must not read as a tie
            raise CkptError(f"{path}: expected {where}tie_word_embeddings to be true or false, "
                            f"got {json.dumps(value)}")
    return config


def config_says_tied(config: dict[str, Any]) -> bool:
    # transformers' PretrainedConfig defaults tie_word_embeddings to True when it is absent
    text = config.get("text_config")
    if "tie_word_embeddings" not in config and isinstance(text, dict):
        return bool(text.get("tie_word_embeddings", True))
    return bool(config.get("tie_word_embeddings", True))


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are one file: the same resolved path, or (a hard link, a bind
    mount) the same device and inode."""
    if absolute(a) == absolute(b):
        return True
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


# --- finding the pair ------------------------------------------------------------------------

def _find(keys: Container[str], names: tuple[str, ...]) -> str | None:
    for name in names:
        for prefix in _PREFIXES:
            if prefix + name in keys:
                return prefix + name
    return None


def recorded_ties(ckpt: Checkpoint) -> dict[str, str]:
    """The ties the file's own metadata records, {key not stored: key stored}: safetensors'
    ``save_model`` writes one entry per key it dropped, tyingspec writes ``tyingspec.tied``."""
    ties = {k: v for k, v in ckpt.metadata.items()
            if k not in ckpt.tensors and v in ckpt.tensors and not k.startswith("tyingspec.")}
    emb, _, hd = ckpt.metadata.get("tyingspec.tied", "").partition("=")
    if emb and hd:
        if emb in ckpt.tensors and hd not in ckpt.tensors:
            ties[hd] = emb
        elif hd in ckpt.tensors and emb not in ckpt.tensors:
            ties[emb] = hd
    return ties


def _check_given(ckpt: Checkpoint, option: str, key: str) -> None:
    """A key named by --embedding/--head must be in the file (or recorded as tied to one that
    is): a typo must not read as a tie with a key that merely is not there."""
    if key in ckpt.tensors or key in recorded_ties(ckpt):
        return
    close = difflib.get_close_matches(key, list(ckpt.tensors), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(k) for k in close)}?" if close else
            f"the file holds {len(ckpt.tensors)} keys, e.g. {_some(ckpt)}")
    raise CkptError(f"{ckpt.path}: missing key {key!r} given by {option}: {hint}")


def find_pair(ckpt: Checkpoint, embedding: str | None = None,
              head: str | None = None) -> tuple[str | None, str | None]:
    """The (embedding, head) keys, either given or found by the names real models use; a
    missing one is None.  Raises :class:`CkptError` when neither is there, when a given key is
    not in the file, and when the two are one key."""
    if embedding is not None and embedding == head:
        raise CkptError(f"--embedding and --head both name {embedding!r}: a key is always "
                        f"\"tied\" to itself; give the embedding's and the head's keys")
    for option, key in (("--embedding", embedding), ("--head", head)):
        if key is not None:
            _check_given(ckpt, option, key)
    emb = embedding if embedding is not None else _find(ckpt.tensors, EMBEDDING_KEYS)
    hd = head if head is not None else _find(ckpt.tensors, HEAD_KEYS)
    recorded = recorded_ties(ckpt)
    if emb is None and hd is not None:  # save_model's own record of the key it dropped
        emb = next((k for k, v in recorded.items() if v == hd), None)
    if hd is not None and hd not in ckpt.tensors and hd not in recorded:
        hd_present = None
    else:
        hd_present = hd
    if emb is None and hd_present is None:
        raise CkptError(f"{ckpt.path}: cannot tell which tensors are tied: missing keys: no "
                        f"embedding key ({', '.join(EMBEDDING_KEYS)}"
                        f") and no head key ({', '.join(HEAD_KEYS)}) found (the file holds "
                        f"{_some(ckpt)}); give --embedding KEY --head KEY")
    if emb is None and hd_present is not None:
        # save_model kept the head's key of a tie: name the embedding after the model's root
        # module ("transformer.", "model.") so a conversion can restore it
        emb = next((c for c in EMBEDDING_KEYS if "." in c.removesuffix(".weight") and any(
            k.startswith(c.split(".")[0] + ".") for k in ckpt.tensors)), None)
    if hd is None and emb is not None:
        # the head's usual name, for a file that dropped it (a tied save) or lost it
        hd = next((k for k, v in recorded.items() if v == emb), None) or _head_name_for(emb)
    if emb is not None and emb == hd:
        raise CkptError(f"{ckpt.path}: the embedding and the head resolve to one key {emb!r}: "
                        f"give --embedding KEY --head KEY naming two keys")
    return emb, hd


#: what a tied pair is, as :func:`find_pairs` returns it: (embedding key, head key, who
#: declares the tie: a transformers class, or None when found by name or given)
Found = tuple[str | None, str | None, str | None]

# a key that names a lookup table (the embedding side of a declared tie; GPT-NeoX's head is
# embed_out)
_LOOKUP = re.compile(r"embed(?!_out)|(^|\.)wte\.|word_emb|tok_emb|(^|\.)shared\.")


def _unwrapped(key: str) -> str:
    for prefix in _PREFIXES[1:]:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def find_pairs(ckpt: Checkpoint, config: dict[str, Any] | None = None,
               embedding: str | None = None, head: str | None = None) -> list[Found]:
    """Every tied pair of ``ckpt``, the embedding/head pair first.  Given keys are the one
    pair; otherwise the ties transformers declares for these names (:mod:`ckpt.pairs`: its
    installed classes) whose two keys are both in the file (with a config naming the model
    type, also one stored key whose partner is not); else the pair found by the names real
    models use (:func:`find_pair`), refused as "cannot tell which tensors are tied" when only
    one of the two is there and another matrix of its shape could be the other."""
    if embedding is None and head is None:
        declared = _declared(ckpt, config)
        if declared:
            return declared
    emb, hd = find_pair(ckpt, embedding, head)
    if embedding is None or head is None:
        _refuse_lookalike(ckpt, emb, hd)
    return [(emb, hd, None)]


def _declared(ckpt: Checkpoint, config: dict[str, Any] | None) -> list[Found]:
    """The pairs of the model classes that best explain the file: of every class whose ties
    are in it, those with the most (T5ForConditionalGeneration's three, not FSMT's one tie of
    encoder to decoder that the same names also satisfy)."""
    # lazy: the command's start-up loads this module for the ckpt parser
    from tyingspec._src.ckpt.pairs import declared_pairs

    recorded = recorded_ties(ckpt)
    names = set(ckpt.tensors) | set(recorded)
    matrices = {_unwrapped(k) for k, t in ckpt.tensors.items() if t.dim() == 2}
    classes, where, by_model_type = declared_pairs(matrices | {_unwrapped(k) for k in recorded},
                                                   config)
    best: list[tuple[tuple[tuple[str, str], ...], str]] = []  # (pairs it explains, class)
    for declared in classes:
        explained = tuple(p for p in (_located(ckpt, names, t, s, by_model_type)
                                      for t, s in declared.ties) if p is not None)
        if explained and (not best or len(explained) >= len(best[0][0])):
            if best and len(explained) > len(best[0][0]):
                best.clear()
            best.append((explained, declared.owner))
    owners: dict[tuple[str, str], list[str]] = {}
    for explained, owner in best:
        for pair in explained:
            owners.setdefault(pair, []).append(owner)
    found: list[Found] = []
    for (emb, hd), who in owners.items():
        # several classes declare one tie (every GPT-2-like head): a few of them, then a count
        named = ", ".join(who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
        found.append((emb, hd, f"{named} in {where}"))
    # the embedding/head pair first (convert and --evaluate work on it); ties between two
    # lookups of one table (T5's encoder and decoder embed_tokens to shared) after it
    found.sort(key=lambda f: bool(f[1] is not None and _LOOKUP.search(f[1])))
    return found


def _located(ckpt: Checkpoint, names: set[str], tied_name: str, source_name: str,
             lone: bool) -> tuple[str, str] | None:
    """(embedding key, head key) of a declared tie as the file names it, or None when the
    file does not hold it: both keys there as matrices (or recorded as tied), or with
    ``lone`` (the config's own model type) the source alone, a tied save."""
    source, tied = _find(names, (source_name,)), _find(names, (tied_name,))
    stored = [k for k in (source, tied) if k is not None and k in ckpt.tensors]
    if not stored or any(ckpt.tensors[k].dim() != 2 for k in stored):
        return None
    if tied is None and source is not None and lone:
        # transformers keeps the source of a tie and drops the tied key
        tied = next((p for p in _PREFIXES if p and source.startswith(p)), "") + tied_name
    if source is None or tied is None:
        return None
    # the lookup is the embedding, whichever side of the tie it is on (BLT ties its
    # local encoder's embed_tokens to lm_head)
    return (tied, source) if _LOOKUP.search(tied) and not _LOOKUP.search(source) \
        else (source, tied)


def _refuse_lookalike(ckpt: Checkpoint, emb: str | None, hd: str | None) -> None:
    """A pair found by name with only one key in the file reads as a tied save; unless
    another matrix of the same shape is there, which may be the other one under a name
    neither tyingspec nor transformers pairs with it (Mamba's ``backbone.embeddings.weight``
    beside ``lm_head.weight`` read ``tied`` over two different matrices)."""
    stored = [k for k in (emb, hd) if k is not None and k in ckpt.tensors]
    if len(stored) != 1 or (emb in recorded_ties(ckpt) or hd in recorded_ties(ckpt)):
        return
    one = ckpt.tensors[stored[0]]
    alike = [k for k, t in ckpt.tensors.items()
             if k != stored[0] and t.dim() == 2 and tuple(t.shape) == tuple(one.shape)]
    if alike:
        role = "embedding" if stored[0] == hd else "head"
        shown = ", ".join(repr(k) for k in alike[:3]) + (", ..." if len(alike) > 3 else "")
        raise CkptError(f"{ckpt.path}: cannot tell which tensors are tied: {stored[0]!r} is "
                        f"found by name and its {role} is not, while {shown} has its shape "
                        f"{list(one.shape)} under a name no known model pairs with it; give "
                        f"--embedding KEY --head KEY")


def _head_name_for(emb: str) -> str:
    if emb.startswith("tok_") or emb == "token_embd.weight":  # Meta's llama, llama.cpp's GGUF
        return "output.weight"
    return "embed_out.weight" if emb.startswith("gpt_neox") else "lm_head.weight"


def _some(ckpt: Checkpoint) -> str:
    keys = list(ckpt.tensors)
    return ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    # every empty storage has data_ptr 0, and one storage can be viewed as two dtypes: neither
    # is one matrix used twice
    return bool(a.numel() > 0 and a.dtype == b.dtype and a.device == b.device
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape
                and a.stride() == b.stride())
