"""``tyingspec ckpt``: inspect the tie in a checkpoint, convert between tied and untied.

Real bugs in this class: the tie source picked by key order (an embedding loaded from
``lm_head.weight``), a tied head missing from the file and left at its random init, safetensors
refusing shared tensors, a config saying ``tie_word_embeddings`` over two different matrices.

Files are read only through ``safetensors`` and ``torch.load(weights_only=True)``: nothing
else is ever unpickled.  A sharded checkpoint (an index JSON with a ``weight_map``) is read as
one.  Every write goes to a temporary file beside OUT and is renamed over it, so an interrupted
run leaves no half-written OUT; the input is never overwritten.  SIGTERM removes that temporary
file before the process ends; a failed write (a full disk) leaves the previous OUT whole; OUT
keeps the mode of the file it replaces; a device or pipe (``/dev/stdout``) is written in place,
as a stream, never replaced by a regular file.  An output that names an input, by any path or
hard link, is refused.

Exit codes: 0 tied or consistent, 1 only a tie that is wrong (two different matrices under a
config that ties them, a lost key the config needs, ``--policy refuse`` refusing), 2 bad input
or usage, one line naming the file or option, what was expected and what was found.  The file
is untrusted input: whatever its parser raises (torch's zip reader, the weights-only
unpickler, the JSON reader) is such a line, never a traceback.  So is whatever the user's
``--evaluate`` factory raises, ``sys.exit`` included.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import hashlib
import importlib
import json
import math
import os
import pickle
import re
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

from tyingspec._src.core.files import (
    OutputError,
    absolute,
    atomic_write,
    check_distinct,
    usable_output,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CkptError", "Checkpoint", "configure_parser", "convert", "inspect", "load",
           "run"]

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


def _first_line(exc: BaseException) -> str:
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
                        f"{_first_line(exc)}") from exc
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
                        f"{_first_line(exc)}") from exc
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
        if shard.endswith(".json") or _same_file(shard_path, path):
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
        raise CkptError(f"{path}: not {what} ({_first_line(exc)})") from exc


def _read_config(path: str) -> dict[str, Any]:
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


def _config_ties(config: dict[str, Any]) -> bool:
    # transformers' PretrainedConfig defaults tie_word_embeddings to True when it is absent
    text = config.get("text_config")
    if "tie_word_embeddings" not in config and isinstance(text, dict):
        return bool(text.get("tie_word_embeddings", True))
    return bool(config.get("tie_word_embeddings", True))


def _same_file(a: str, b: str) -> bool:
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


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    # every empty storage has data_ptr 0, and one storage can be viewed as two dtypes: neither
    # is one matrix used twice
    return bool(a.numel() > 0 and a.dtype == b.dtype and a.device == b.device
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape
                and a.stride() == b.stride())


# --- inspect ---------------------------------------------------------------------------------

def _bias_key(ckpt: Checkpoint, head: str | None) -> str | None:
    candidates = ["final_logits_bias"]
    if head is not None and head.endswith(".weight"):
        candidates.insert(0, head[: -len(".weight")] + ".bias")
    return next((k for k in candidates if k in ckpt.tensors), None)


def _difference(e: torch.Tensor, h: torch.Tensor) -> dict[str, Any]:
    import torch

    e64, h64 = e.detach().to(torch.float64), h.detach().to(torch.float64)
    diff = e64 - h64
    norm_e = float(torch.linalg.norm(e64))
    cos = torch.nn.functional.cosine_similarity(e64, h64, dim=1, eps=1e-300)
    q = torch.quantile(cos, torch.tensor([0.0, 0.05, 0.5, 0.95, 1.0], dtype=torch.float64))
    return {"max_abs_diff": float(diff.abs().max()),
            "rel_frobenius": float(torch.linalg.norm(diff)) / norm_e if norm_e else math.inf,
            "row_cosine": {"min": float(q[0]), "p05": float(q[1]), "median": float(q[2]),
                           "p95": float(q[3]), "max": float(q[4]), "mean": float(cos.mean())}}


def inspect(ckpt: Checkpoint, config: dict[str, Any] | None = None,
            embedding: str | None = None, head: str | None = None) -> dict[str, Any]:
    """The tie's state in ``ckpt`` as a JSON-ready dict (see the README for its fields)."""
    emb, hd = find_pair(ckpt, embedding, head)
    e = ckpt.tensors.get(emb) if emb is not None else None
    h = ckpt.tensors.get(hd) if hd is not None else None
    config_ties = _config_ties(config) if config is not None else None
    notes: list[str] = []
    pair: dict[str, Any] = {"embedding": emb, "head": hd}
    for name, t in (("embedding", e), ("head", h)):
        pair[f"{name}_shape"] = list(t.shape) if t is not None else None
        pair[f"{name}_dtype"] = str(t.dtype).removeprefix("torch.") if t is not None else None
    one = e if e is not None else h
    assert one is not None  # find_pair guarantees one of the two
    for name, key, t in (("embedding", emb, e), ("head", hd, h)):
        if t is not None and (t.dim() != 2 or t.numel() == 0):
            raise CkptError(f"{ckpt.path}: expected the {name} {key!r} to be a non-empty "
                            f"matrix [vocab, d], got shape {list(t.shape)} "
                            f"{str(t.dtype).removeprefix('torch.')}"
                            + (" (an empty placeholder, as a ZeRO-3 or meta-device save "
                               "leaves)" if t.numel() == 0 else ""))
    if e is not None and h is not None:
        if _same_storage(e, h):
            state = "tied"
        elif e.shape == h.shape and e.dtype == h.dtype and torch_equal(e, h):
            state = "equal"
        else:
            state = "different"
    else:
        missing = "head" if h is None else "embedding"
        # A tied save keeps one key: safetensors' save_model (it cannot hold shared tensors),
        # transformers' save_pretrained, a torch file re-saved from either.  The verdict rests
        # on the tensors and the config, never on the container: the same tensors as .pt and
        # as .safetensors once read differently (a lone key "lost" in one, exit 1, and "tied"
        # in the other, exit 0).  With no config, a lone key reads as transformers reads it,
        # tie_word_embeddings defaulting to true.
        ties = config_ties if config_ties is not None else True
        state = "tied" if ties else f"{missing}-missing"
        if state == "tied" and config_ties is None and not recorded_ties(ckpt):
            notes.append("nothing in the file records the tie and no --config was given: read "
                         "as tied, as transformers' default tie_word_embeddings=true reads it; "
                         "give --config to tell a tie from a lost "
                         f"{'head' if h is None else 'embedding'}")
        if state == "tied":
            notes.append(f"one tensor on disk, under {(emb if e is not None else hd)!r}; "
                         f"a loader must tie {hd if e is not None else emb!r} to it")
            if e is None:
                notes.append("the tensor is stored under the head's key: a loader that takes "
                             "the tie source by key order loads the embedding from it")
        else:
            notes.append(f"the {missing} {(hd if h is None else emb)!r} is not in the file: a "
                         f"model loading it keeps its random init (or zeros) there")
    pair["state"] = state
    if state == "different":
        assert e is not None and h is not None
        if e.shape == h.shape:
            pair["difference"] = _difference(e, h)
            if not bool(h.detach().abs().max() > 0):
                notes.append("the head is all zeros: a head left uninitialised")
    if e is not None and h is not None and e.shape != h.shape:
        if e.dim() == 2 and h.dim() == 2 and e.shape[1] != h.shape[1]:
            pair["dimension_mismatch"] = (f"embedding d={e.shape[1]}, head d={h.shape[1]}: a "
                                          f"different d needs a projection, not a tie")
        else:
            pair["dimension_mismatch"] = (f"embedding {list(e.shape)} vs head {list(h.shape)}: "
                                          f"these cannot share one matrix")
        notes.append(pair["dimension_mismatch"])
    bias = _bias_key(ckpt, hd)
    if bias is not None:
        pair["output_bias"] = {"key": bias, "shape": list(ckpt.tensors[bias].shape)}
        notes.append(f"output bias {bias!r}: a separate decision, kept as it is by convert "
                     f"(never merged into the tie or dropped)")
    else:
        pair["output_bias"] = None
    if state in ("equal", "different") and "dimension_mismatch" not in pair:
        pair["tying_saves"] = {"parameters": one.numel(),
                               "bytes": one.numel() * one.element_size()}
    else:
        pair["tying_saves"] = None
    agrees: bool | None = None
    if config_ties is not None:
        if state.endswith("-missing"):
            agrees = False
            notes.append(f"the config says tie_word_embeddings={config_ties} and the file lacks "
                         f"the {state.removesuffix('-missing')}")
        elif config_ties:
            agrees = state in ("tied", "equal")
            if state == "different":
                notes.append("the config says tie_word_embeddings=true but the file holds two "
                             "different matrices: loading it keeps one and discards the other")
        else:
            agrees = state != "tied"
    pair["config_tie_word_embeddings"] = config_ties
    pair["config_agrees"] = agrees
    pair["notes"] = notes
    return {"schema": "tyingspec.ckpt/1", "file": ckpt.path, "format": ckpt.format,
            "files": ckpt.files, "tensors": len(ckpt.tensors),
            "metadata": {k: v for k, v in ckpt.metadata.items() if k.startswith("tyingspec.")},
            "pairs": [pair]}


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs in the same places count as equal)."""
    import torch

    return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def render(report: dict[str, Any]) -> str:
    """The inspect report as text."""
    lines = [f"{report['file']} ({report['format']}, {report['tensors']} tensors"
             + (f", {len(report['files'])} shards" if len(report["files"]) > 1 else "") + ")"]
    for p in report["pairs"]:
        for name in ("embedding", "head"):
            where = (f"{p[name + '_shape']} {p[name + '_dtype']}" if p[name + "_shape"]
                     else "(not in the file)")
            lines.append(f"  {name:<9} {p[name]!r} {where}")
        lines.append(f"  state: {p['state']}")
        d = p.get("difference")
        if d:
            c = d["row_cosine"]
            lines.append(f"  max |delta| {d['max_abs_diff']:.4g}, relative Frobenius "
                         f"{d['rel_frobenius']:.4g}")
            lines.append(f"  per-row cosine: min {c['min']:.4f}, p05 {c['p05']:.4f}, median "
                         f"{c['median']:.4f}, p95 {c['p95']:.4f}, max {c['max']:.4f}")
        s = p["tying_saves"]
        if s:
            lines.append(f"  tying would save {s['parameters']:,} parameters "
                         f"({s['bytes']:,} bytes)")
        if p["config_tie_word_embeddings"] is not None:
            verdict = "agrees" if p["config_agrees"] else "DISAGREES"
            ties = "true" if p["config_tie_word_embeddings"] else "false"
            lines.append(f"  config tie_word_embeddings={ties}: {verdict} with the file")
        for note in p["notes"]:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


# --- convert ---------------------------------------------------------------------------------

@dataclass
class Converted:
    """A converted state dict and what it records."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    refused: str | None = None  # the reason ``refuse`` stopped, when it did


def _tie_matrix(e: torch.Tensor, h: torch.Tensor, policy: str, tolerance: float,
                path: str) -> tuple[torch.Tensor, str | None]:
    import torch

    if policy == "output":
        return h, None
    if policy == "average":
        # the mean is taken in float64 and rounded once, so averaging two equal matrices
        # returns them bit for bit
        return ((e.to(torch.float64) + h.to(torch.float64)) / 2).to(e.dtype), None
    if policy == "refuse":
        # a NaN in either matrix makes the gap NaN, and NaN > tolerance is False: bit-equal
        # matrices (NaNs in the same places) have no gap, any other NaN refuses
        gap = 0.0 if torch_equal(e, h) else float(
            (e.to(torch.float64) - h.to(torch.float64)).abs().max())
        if not gap <= tolerance:
            return e, (f"{path}: the embedding and the head differ by max |delta| {gap:.4g} > "
                       f"--tolerance {tolerance:g}; refusing to tie (choose --policy input, "
                       f"output or average)")
    return e, None


def check_policy(to: str, policy: str | None, tolerance: float | None) -> None:
    """Refuse a --policy or --tolerance that means nothing for ``to``, and a tolerance that is
    not a finite number >= 0 (NaN compares false with every gap: "refuse" would tie anything)."""
    if to not in ("tied", "untied"):
        raise CkptError(f"--to: expected tied or untied, got {to!r}")
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise CkptError(f"--tolerance: expected a finite number >= 0 (the largest |delta| "
                        f"--policy refuse accepts), got {tolerance!r}")
    if to == "untied":
        # untying copies the one matrix into both keys (or keeps the two it finds): there is
        # no matrix to choose
        if policy is not None:
            raise CkptError(f"--policy {policy}: a policy chooses the tied matrix; --to untied "
                            f"gives the head a copy of the embedding and takes no --policy")
        if tolerance is not None:
            raise CkptError("--tolerance: only --policy refuse reads it; --to untied takes no "
                            "--tolerance")
        return
    if policy is None:
        raise CkptError("--to tied needs --policy input|output|average|refuse")
    if policy not in POLICIES:
        raise CkptError(f"--policy: expected one of {', '.join(POLICIES)}, got {policy!r}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise CkptError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    return digest.hexdigest()


def convert(ckpt: Checkpoint, to: str, policy: str | None, tolerance: float | None = None,
            config: dict[str, Any] | None = None, embedding: str | None = None,
            head: str | None = None) -> Converted:
    """Convert ``ckpt`` to ``to`` ("tied" or "untied") under ``policy``; every tensor other
    than the head and embedding is the same object as in ``ckpt`` (copied bit for bit).
    ``tolerance`` (default 0: bit-equal) is read by ``refuse`` only."""
    check_policy(to, policy, tolerance)
    report = inspect(ckpt, config, embedding, head)
    pair = report["pairs"][0]
    emb, hd, state = pair["embedding"], pair["head"], pair["state"]
    if "dimension_mismatch" in pair:
        raise CkptError(f"{ckpt.path}: shape mismatch: embedding {emb!r} has shape "
                        f"{pair['embedding_shape']}, head {hd!r} has shape {pair['head_shape']}"
                        f" ({pair['dimension_mismatch']})")
    if state.endswith("-missing"):
        raise CkptError(f"{ckpt.path}: missing key {(hd if state == 'head-missing' else emb)!r}"
                        f": the {state.removesuffix('-missing')} is not in the file, so there "
                        f"is nothing to {'tie' if to == 'tied' else 'untie'}")
    if emb is None or hd is None:
        raise CkptError(f"{ckpt.path}: the tied tensor is stored under {hd or emb!r} and the "
                        f"other key is unknown: give --embedding KEY --head KEY")
    e = ckpt.tensors.get(emb)
    h = ckpt.tensors.get(hd)
    if e is None or h is None:
        source = e if e is not None else h
        assert source is not None
        e = h = source
    if e.dtype != h.dtype:
        raise CkptError(f"{ckpt.path}: dtype mismatch: embedding {emb!r} is "
                        f"{pair['embedding_dtype']}, head {hd!r} is {pair['head_dtype']}")
    out: dict[str, torch.Tensor] = {}
    # the source's own record of this pair's tie (save_model's) no longer holds once rewritten
    meta = {k: v for k, v in ckpt.metadata.items()
            if not k.startswith("tyingspec.") and k not in (emb, hd)}
    # the source by name and content, never by an absolute path of the user's machine (that
    # would ship with the checkpoint)
    meta.update({"tyingspec.to": to, "tyingspec.source": os.path.basename(ckpt.path),
                 "tyingspec.source_sha256": _sha256(ckpt.path)})
    if policy is not None:
        meta["tyingspec.policy"] = policy
    refused = None
    if to == "tied":
        assert policy is not None
        matrix, refused = _tie_matrix(e, h, policy, 0.0 if tolerance is None else tolerance,
                                      ckpt.path)
        meta["tyingspec.tied"] = f"{emb}={hd}"
        for key, t in ckpt.tensors.items():
            if key == emb:
                out[emb] = matrix
                out[hd] = matrix
            elif key != hd:
                out[key] = t
        if emb not in ckpt.tensors:
            out[emb] = out[hd] = matrix
    else:
        for key, t in ckpt.tensors.items():
            if key in (emb, hd):
                continue
            out[key] = t
        # the head gets storage of its own; the embedding keeps the bits it had
        out[emb] = e
        out[hd] = h.clone() if _same_storage(e, h) else h
    return Converted(out, meta, refused)


def _mode_for(target: str) -> int:
    """The mode OUT gets: the existing file's, else what the umask gives a new file (mkstemp
    alone would leave every OUT at 0600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _is_stream(path: str) -> bool:
    """An existing path that is no regular file (``/dev/stdout``, a pipe, a device): written
    in place as a stream, since a temporary file renamed over it would replace the device node
    with a regular file."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _write_reason(exc: Exception) -> str:
    """Why a write failed, in one line: the OS error behind it when there is one (safetensors
    reports ENOSPC as ``SafetensorError: ... I/O error: No space left on device (os error
    28)``)."""
    cause: BaseException | None = exc
    while cause is not None:
        # torch.save's zip writer, failing in its __exit__, raises a RuntimeError ("unexpected
        # pos") while handling the OSError of the write: the OSError is the reason
        if isinstance(cause, OSError):
            return cause.strerror or str(cause)
        cause = cause.__cause__ or cause.__context__
    found = re.search(r"os error (\d+)", str(exc))
    return os.strerror(int(found.group(1))) if found else _first_line(exc)


class _WriteAll:
    """The ``write`` torch.save calls: every byte reaches the file descriptor, or the OS error
    that stopped it is raised."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]
        return len(data)

    def flush(self) -> None:
        pass


def _serialise(converted: Converted, fmt: str, tie: tuple[str, str] | None,
               fh: IO[bytes] | None, path: str | None) -> None:
    """Write ``converted`` to the open binary file ``fh``, or (safetensors, which writes by
    name) to ``path``."""
    if fmt == "safetensors":
        from safetensors.torch import save, save_file

        tensors = dict(converted.tensors)
        if tie is not None:
            tensors.pop(tie[1], None)  # safetensors holds one key of a tie, as save_model
        seen: set[tuple[int, int]] = set()  # (storage, offset) of each tensor written
        for key, t in tensors.items():
            # safetensors refuses tensors that share memory; a copy keeps the bits
            span = (int(t.untyped_storage().data_ptr()), int(t.storage_offset()))
            if span in seen or not t.is_contiguous():
                tensors[key] = t.contiguous().clone()
            seen.add(span)
        if path is not None:
            save_file(tensors, path, metadata=converted.metadata)
        else:
            assert fh is not None
            fh.write(save(tensors, metadata=converted.metadata))
    else:
        import torch

        sd: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(
            converted.tensors)
        # load_state_dict reads only "version" from this; the tyingspec keys ride along
        setattr(sd, "_metadata", collections.OrderedDict(  # noqa: B010
            {"": dict(converted.metadata)}))
        # through a writer that writes every byte or raises, so a full disk is an OSError
        # naming ENOSPC: given a path, or a file whose write() returns short, torch reports
        # only "[enforce fail at inline_container.cc] unexpected pos 1280 vs 1232"
        assert fh is not None
        torch.save(sd, cast("IO[bytes]", _WriteAll(fh.fileno())))


def _write(converted: Converted, path: str, fmt: str, tie: tuple[str, str] | None) -> None:
    """Write OUT atomically (a temporary file beside it, renamed over it) keeping its mode, or
    as a stream when OUT is a device or pipe.  A failed write is a :class:`CkptError`, and
    leaves the previous OUT whole and no temporary file."""
    target = absolute(path)
    if _is_stream(path):  # as given: /dev/stdout resolves to /proc/PID/fd/pipe:[N]
        try:
            with open(path, "wb") as fh:
                _serialise(converted, fmt, tie, fh, None)
        except Exception as exc:
            raise CkptError(f"OUT {path}: cannot be written ({_write_reason(exc)})") from exc
        return
    mode = _mode_for(target)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                                   dir=os.path.dirname(target))
        with os.fdopen(fd, "wb") as fh:
            if fmt == "safetensors":
                _serialise(converted, fmt, tie, None, tmp)
            else:
                _serialise(converted, fmt, tie, fh, None)
                fh.flush()
        with open(tmp, "rb") as check:
            os.fsync(check.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except Exception as exc:
        before = "the previous file is unchanged" if os.path.exists(target) else "nothing " \
            "was written"
        raise CkptError(f"OUT {path}: cannot be written ({_write_reason(exc)}); {before}"
                        ) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _write_text(option: str, path: str, text: str) -> None:
    """A JSON report or config: in place when ``path`` is a stream, else atomically."""
    stream = _is_stream(path)
    try:
        if stream:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        else:
            atomic_write(path, text)
    except OSError as exc:
        raise CkptError(f"{option} {path}: cannot be written ({exc.strerror or exc})"
                        + ("" if stream else "; the previous file, if any, is unchanged")
                        ) from exc


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised where the program was, so every ``finally`` (the
    removal of a temporary file) runs before the process ends."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`_Terminated` while the command runs.  Only a
    signal still at its default (which would end the process with OUT's temporary file left
    behind) is taken over, and only in the main thread, where Python runs handlers."""
    import threading

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for taken, old in previous.items():
            signal.signal(taken, old)


# --- evaluate --------------------------------------------------------------------------------

@contextlib.contextmanager
def _guarded(spec: str, during: str) -> Iterator[None]:
    """The user's code (its import, the factory, load_state_dict, the forward) runs in here:
    whatever it raises, ``sys.exit`` included, is a :class:`CkptError` naming the factory,
    never a traceback or an exit status of the user's choosing (``SystemExit(0)`` would read as
    a written OUT)."""
    try:
        yield
    except (CkptError, KeyboardInterrupt, _Terminated):
        raise
    except SystemExit as exc:
        raise CkptError(f"--evaluate {spec}: {during} called sys.exit({exc.code!r}); expected "
                        f"it to return") from exc
    except BaseException as exc:
        raise CkptError(f"--evaluate {spec}: {during} raised {_first_line(exc)}") from exc


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
                            f"{_first_line(exc.__cause__)}") from exc
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


# --- the command -----------------------------------------------------------------------------

def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add ``inspect`` and ``convert`` to the ``ckpt`` subparser."""
    sub = p.add_subparsers(dest="ckpt_command")
    i = sub.add_parser("inspect", help="report the tie between embedding and head in FILE",
                       description="Exit 0 the file is consistent, 1 the head or embedding is "
                                   "missing or the config disagrees with the file, 2 bad input.")
    i.add_argument("file", metavar="FILE",
                   help=".safetensors, torch file (.pt/.bin) or a sharded index .json")
    i.add_argument("--config", metavar="config.json")
    i.add_argument("--embedding", metavar="KEY")
    i.add_argument("--head", metavar="KEY")
    i.add_argument("--json", metavar="PATH", help="write the report as JSON")
    c = sub.add_parser("convert", help="write a tied or untied copy of IN to OUT",
                       description="Exit 0 written, 1 --policy refuse stopped, 2 bad input.")
    c.add_argument("input", metavar="IN")
    c.add_argument("output", metavar="OUT", help="format from its extension: .safetensors or "
                                                 ".pt/.pth/.bin")
    c.add_argument("--to", choices=("tied", "untied"), required=True)
    c.add_argument("--policy", choices=POLICIES,
                   help="the tied matrix: the embedding (input), the head (output), their mean "
                        "(average), or refuse when they differ by more than --tolerance")
    c.add_argument("--tolerance", type=float, default=None, metavar="T",
                   help="max |delta| refuse accepts (default 0: bit-equal)")
    c.add_argument("--config", metavar="config.json",
                   help="its tie_word_embeddings is set in --config-out")
    c.add_argument("--config-out", metavar="PATH",
                   help="where the updated config goes (default: config.json beside OUT)")
    c.add_argument("--embedding", metavar="KEY")
    c.add_argument("--head", metavar="KEY")
    c.add_argument("--evaluate", metavar="TARGET",
                   help="module:attr, a zero-argument factory of the nn.Module: report each "
                        "policy's loss on --tokens next to the original's")
    c.add_argument("--tokens", metavar="FILE", help=".npy or text file of token ids")


def _out_format(path: str) -> str:
    if path.endswith(SAFETENSORS_EXT):
        return "safetensors"
    if path.endswith(TORCH_EXT):
        return "torch"
    raise CkptError(f"OUT {path!r}: expected a .safetensors, .pt, .pth, .bin or .ckpt file")


def _refuse_same(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """An output naming an input (by path, symlink or hard link) would destroy what is being
    read: a usage error, checked before anything is written."""
    for out_name, out in outputs.items():
        for in_name, src in inputs.items():
            if out and src and _same_file(out, src):
                raise CkptError(f"{out_name} {out!r} is the same file as {in_name} {src!r}: "
                                f"tyingspec never overwrites what it reads; give "
                                f"{out_name.split(' (')[0]} another file")


def _inputs(args: argparse.Namespace, ckpt: Checkpoint | None) -> dict[str, str | None]:
    named: dict[str, str | None] = {"the input": getattr(args, "file", None) or getattr(
        args, "input", None), "--config": args.config, "--tokens": getattr(args, "tokens", None)}
    for i, shard in enumerate(ckpt.files if ckpt is not None else []):
        named[f"shard {i + 1} of the input"] = shard
    return named


def _run_inspect(args: argparse.Namespace) -> int:
    if args.json:
        usable_output("--json", args.json)
        _refuse_same({"--json": args.json}, _inputs(args, None))
    config = _read_config(args.config) if args.config else None
    ckpt = load(args.file)
    if args.json:
        _refuse_same({"--json": args.json}, _inputs(args, ckpt))
    report = inspect(ckpt, config, args.embedding, args.head)
    print(render(report))
    if args.json:
        _write_text("--json", args.json, json.dumps(report, indent=2) + "\n")
    pair = report["pairs"][0]
    bad = pair["state"].endswith("-missing") or pair["config_agrees"] is False
    return EXIT_WRONG if bad else EXIT_OK


def _run_convert(args: argparse.Namespace) -> int:
    out = usable_output("OUT", args.output)
    fmt = _out_format(args.output)  # by the name given: a symlink's target may have none
    ckpt_in = args.input
    if args.evaluate is not None and args.tokens is None or \
            args.tokens is not None and args.evaluate is None:
        raise CkptError("--evaluate TARGET and --tokens FILE go together")
    check_policy(args.to, args.policy, args.tolerance)
    if args.tolerance is not None and args.policy != "refuse" and args.evaluate is None:
        raise CkptError(f"--tolerance: only --policy refuse (or --evaluate, which reports "
                        f"refuse) reads it; --policy {args.policy} ignores it")
    config_out = None
    if args.config is not None:
        config_out = usable_output("--config-out", args.config_out or os.path.join(
            os.path.dirname(out), "config.json"))
        check_distinct({"OUT": out, "--config-out": config_out})
    elif args.config_out is not None:
        raise CkptError("--config-out: it writes the updated --config; give --config too")
    outputs = {"OUT": args.output, "--config-out" if args.config_out else
               "--config-out (default: config.json beside OUT)": args.config_out or config_out}
    _refuse_same(outputs, _inputs(args, None))
    config = _read_config(args.config) if args.config else None
    ckpt = load(ckpt_in)
    _refuse_same(outputs, _inputs(args, ckpt))
    if args.evaluate is not None:
        rows = evaluate(ckpt, args.evaluate, read_tokens(args.tokens), args.tolerance, config,
                        args.embedding, args.head)
        original = rows[0][1]
        assert original is not None
        print(f"{'model':<10} {'loss':>12} {'vs original':>14}")
        for name, loss in rows:
            if loss is None:
                print(f"{name:<10} {'refused':>12}")
            else:
                print(f"{name:<10} {loss:>12.6f} {loss - original:>+14.3e}")
    converted = convert(ckpt, args.to, args.policy, args.tolerance, config, args.embedding,
                        args.head)
    if converted.refused:
        print(f"tyingspec ckpt: {converted.refused}; {args.output} not written", file=sys.stderr)
        return EXIT_WRONG
    tie = None
    if args.to == "tied":
        emb, hd = converted.metadata["tyingspec.tied"].split("=", 1)
        tie = (emb, hd)
    _write(converted, args.output, fmt, tie)
    if config is not None and config_out is not None:
        config = dict(config)
        config["tie_word_embeddings"] = args.to == "tied"
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"],
                                     "tie_word_embeddings": args.to == "tied"}
        _write_text("--config-out", config_out, json.dumps(config, indent=2) + "\n")
    stored = len(converted.tensors) - (1 if tie is not None and fmt == "safetensors" else 0)
    how = f"tied, policy {args.policy}" if args.to == "tied" else "untied"
    print(f"wrote {args.output} ({how}, {stored} tensors)"
          + (f"; config {config_out}" if config_out else ""))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Dispatch ``tyingspec ckpt inspect|convert``; bad input is a message and exit 2.  SIGTERM
    or SIGHUP while it runs removes the temporary file of a write in progress, then ends the
    process by that signal."""
    try:
        with _signals_raise():
            if args.ckpt_command == "inspect":
                return _run_inspect(args)
            if args.ckpt_command == "convert":
                return _run_convert(args)
    except (CkptError, OutputError) as exc:
        print(f"tyingspec ckpt: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _Terminated as stop:
        # the finally clauses have run (no temporary file is left): now end as the signal
        # would have, so a supervisor sees what happened
        name = signal.Signals(stop.signum).name
        print(f"tyingspec ckpt: stopped by {name}; nothing half-written is left", file=sys.stderr)
        sys.stderr.flush()
        signal.signal(stop.signum, signal.SIG_DFL)
        os.kill(os.getpid(), stop.signum)
        return 128 + stop.signum
    print("tyingspec ckpt: expected a subcommand, inspect or convert", file=sys.stderr)
    return EXIT_USAGE
