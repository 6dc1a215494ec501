"""Reading a checkpoint as one state dict, and finding its embedding/head pair.

Files are read only through ``safetensors`` and ``torch.load(weights_only=True)``: nothing
else is ever unpickled.  A sharded checkpoint (an index JSON with a ``weight_map``) is read as
one.  The file is untrusted input: whatever its parser raises (torch's zip reader, the
weights-only unpickler, the JSON reader) becomes a :class:`CkptError` line, never a traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import pickle
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


class CkptError(Exception):
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


def _load_one(path: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    _regular_file(path, "")
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

def _find(keys: dict[str, Any], names: tuple[str, ...]) -> str | None:
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
        raise CkptError(f"{ckpt.path}: missing keys: no embedding key ({', '.join(EMBEDDING_KEYS)}"
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
