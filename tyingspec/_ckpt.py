"""``tyingspec ckpt``: inspect the tie in a checkpoint, convert between tied and untied.

Real bugs in this class: the tie source picked by key order (an embedding loaded from
``lm_head.weight``), a tied head missing from the file and left at its random init, safetensors
refusing shared tensors, a config saying ``tie_word_embeddings`` over two different matrices.

Files are read only through ``safetensors`` and ``torch.load(weights_only=True)``: nothing
else is ever unpickled.  A sharded checkpoint (an index JSON with a ``weight_map``) is read as
one.  Every write goes to a temporary file beside OUT and is renamed over it, so an interrupted
run leaves no half-written OUT; the input is never overwritten.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import os
import pickle
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._files import OutputError, absolute, atomic_write, check_distinct, usable_output

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
                  "embeddings.word_embeddings.weight", "embed_tokens.weight", "wte.weight")
HEAD_KEYS = ("lm_head.weight", "output.weight", "embed_out.weight")
# torch.compile and DistributedDataParallel prefix every key of a saved state dict
_PREFIXES = ("", "_orig_mod.", "module.")
SAFETENSORS_EXT = (".safetensors",)
TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")
POLICIES = ("input", "output", "average", "refuse")


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


def _load_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = fh.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CkptError(f"{path}: not a readable safetensors file (truncated or corrupt?): "
                        f"{exc}") from exc
    return tensors, metadata


def _state_dict_from(obj: Any, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import torch

    # nanoGPT's ckpt.pt and Lightning wrap the state dict: {"model": ..., "optimizer": ...}
    if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("model", "state_dict", "module"):
            if isinstance(obj.get(key), dict):
                return _state_dict_from(obj[key], path)
    if not isinstance(obj, dict) or not obj:
        raise CkptError(f"{path}: expected a state dict (a mapping of names to tensors), got "
                        f"{type(obj).__name__}")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CkptError(f"{path}: expected a tensor under every key, key {bad[0]!r} holds "
                        f"{type(obj[bad[0]]).__name__}")
    meta: dict[str, str] = {}
    saved = getattr(obj, "_metadata", None)
    if isinstance(saved, dict) and isinstance(saved.get(""), dict):
        meta = {k: str(v) for k, v in saved[""].items() if str(k).startswith("tyingspec.")}
    return {str(k): v for k, v in obj.items()}, meta


def _load_torch(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CkptError(f"{path}: refused by torch.load(weights_only=True), which only loads "
                        f"tensors and plain containers; tyingspec never unpickles anything "
                        f"else ({first})") from exc
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CkptError(f"{path}: not a readable torch file (truncated or corrupt?): "
                        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0:1]}") from exc
    return _state_dict_from(obj, path)


def _load_one(path: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    if not os.path.isfile(path):
        raise CkptError(f"{path}: no such file")
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
    base = os.path.dirname(path)
    merged: dict[str, torch.Tensor] = {}
    formats: set[str] = set()
    files: list[str] = []
    merged_meta: dict[str, str] = {}
    for shard in sorted(set(map(str, weight_map.values()))):
        shard_path = os.path.join(base, shard)
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
        raise CkptError(f"{path}: cannot be read ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise CkptError(f"{path}: not {what} ({exc})") from exc


def _read_config(path: str) -> dict[str, Any]:
    config = _read_json(path, "a JSON config")
    if not isinstance(config, dict):
        raise CkptError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _config_ties(config: dict[str, Any]) -> bool:
    # transformers' PretrainedConfig defaults tie_word_embeddings to True when it is absent
    text = config.get("text_config")
    if "tie_word_embeddings" not in config and isinstance(text, dict):
        return bool(text.get("tie_word_embeddings", True))
    return bool(config.get("tie_word_embeddings", True))


# --- finding the pair ------------------------------------------------------------------------

def _find(keys: dict[str, Any], names: tuple[str, ...]) -> str | None:
    for name in names:
        for prefix in _PREFIXES:
            if prefix + name in keys:
                return prefix + name
    return None


def find_pair(ckpt: Checkpoint, embedding: str | None = None,
              head: str | None = None) -> tuple[str | None, str | None]:
    """The (embedding, head) keys, either given or found by the names real models use; a
    missing one is None.  Raises :class:`CkptError` when neither is there."""
    for option, key in (("--embedding", embedding), ("--head", head)):
        if key is not None and key not in ckpt.tensors and option == "--embedding":
            raise CkptError(f"{ckpt.path}: missing key {key!r} given by {option} (the file "
                            f"holds {len(ckpt.tensors)} keys, e.g. {_some(ckpt)})")
    emb = embedding if embedding is not None else _find(ckpt.tensors, EMBEDDING_KEYS)
    hd = head if head is not None else _find(ckpt.tensors, HEAD_KEYS)
    if hd is not None and hd not in ckpt.tensors:
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
        hd = "lm_head.weight" if not emb.startswith(("tok_", "gpt_neox")) else (
            "output.weight" if emb.startswith("tok_") else "embed_out.weight")
    return emb, hd


def _some(ckpt: Checkpoint) -> str:
    keys = list(ckpt.tensors)
    return ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
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
    recorded = ckpt.metadata.get("tyingspec.tied")
    notes: list[str] = []
    pair: dict[str, Any] = {"embedding": emb, "head": hd}
    for name, t in (("embedding", e), ("head", h)):
        pair[f"{name}_shape"] = list(t.shape) if t is not None else None
        pair[f"{name}_dtype"] = str(t.dtype).removeprefix("torch.") if t is not None else None
    one = e if e is not None else h
    assert one is not None  # find_pair guarantees one of the two
    if e is not None and h is not None:
        if _same_storage(e, h):
            state = "tied"
        elif e.shape == h.shape and e.dtype == h.dtype and torch_equal(e, h):
            state = "equal"
        else:
            state = "different"
    else:
        missing = "head" if h is None else "embedding"
        # safetensors cannot hold shared tensors, so a tied save keeps one key (save_model);
        # a torch file keeps both names, so a lone key there is a lost one, unless the config
        # or tyingspec's own metadata says it was tied
        ties = config_ties if config_ties is not None else (
            recorded is not None or ckpt.format != "torch")
        state = "tied" if ties else f"{missing}-missing"
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
        gap = float((e.to(torch.float64) - h.to(torch.float64)).abs().max())
        if gap > tolerance:
            return e, (f"{path}: the embedding and the head differ by max |delta| {gap:.4g} > "
                       f"--tolerance {tolerance:g}; refusing to tie (choose --policy input, "
                       f"output or average)")
    return e, None


def convert(ckpt: Checkpoint, to: str, policy: str | None, tolerance: float = 0.0,
            config: dict[str, Any] | None = None, embedding: str | None = None,
            head: str | None = None) -> Converted:
    """Convert ``ckpt`` to ``to`` ("tied" or "untied") under ``policy``; every tensor other
    than the head and embedding is the same object as in ``ckpt`` (copied bit for bit)."""
    report = inspect(ckpt, config, embedding, head)
    pair = report["pairs"][0]
    emb, hd, state = pair["embedding"], pair["head"], pair["state"]
    if "dimension_mismatch" in pair:
        raise CkptError(f"{ckpt.path}: shape mismatch: embedding {emb!r} has shape "
                        f"{pair['embedding_shape']}, head {hd!r} has shape {pair['head_shape']}"
                        f" ({pair['dimension_mismatch']})")
    if to == "tied" and policy is None:
        raise CkptError("--to tied needs --policy input|output|average|refuse")
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
    meta = {k: v for k, v in ckpt.metadata.items() if not k.startswith("tyingspec.")}
    meta.update({"tyingspec.to": to, "tyingspec.source": absolute(ckpt.path),
                 "tyingspec.policy": policy or "input"})
    refused = None
    if to == "tied":
        assert policy is not None
        matrix, refused = _tie_matrix(e, h, policy, tolerance, ckpt.path)
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


def _write(converted: Converted, path: str, fmt: str, tie: tuple[str, str] | None) -> None:
    target = absolute(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=os.path.dirname(target))
    os.close(fd)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

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
            save_file(tensors, tmp, metadata=converted.metadata)
        else:
            import torch

            sd: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(
                converted.tensors)
            # load_state_dict reads only "version" from this; the tyingspec keys ride along
            setattr(sd, "_metadata", collections.OrderedDict(  # noqa: B010
                {"": dict(converted.metadata)}))
            torch.save(sd, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- evaluate --------------------------------------------------------------------------------

def _factory(spec: str) -> nn.Module:
    from torch import nn

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CkptError(f"--evaluate: expected module:attr, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise CkptError(f"--evaluate {spec}: cannot be imported ({exc})") from exc
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
    except (OSError, ValueError) as exc:
        raise CkptError(f"--tokens {path}: expected integer token ids ({exc})") from exc
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2) or arr.size < 2:
        raise CkptError(f"--tokens {path}: expected at least 2 integer ids in a 1-D or 2-D "
                        f"array, got dtype {arr.dtype} and shape {list(arr.shape)}")
    return torch.from_numpy(arr.astype(np.int64))


def _windows(tokens: torch.Tensor, model: nn.Module) -> torch.Tensor:
    if tokens.dim() == 2:
        return tokens
    config = getattr(model, "config", None)
    block = getattr(config, "block_size", None) or getattr(config, "n_positions", None)
    length = min(int(block), tokens.numel() - 1) if block else tokens.numel() - 1
    rows = (tokens.numel() - 1) // length
    return tokens[: rows * length + 1].unfold(0, length + 1, length)[:rows]


def _load_into(spec: str, tensors: dict[str, torch.Tensor], emb: str, hd: str,
               untie: bool) -> nn.Module:
    import torch
    from torch import nn

    model = _factory(spec)
    try:
        model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        raise CkptError(f"--evaluate {spec}: the checkpoint does not fit the model: "
                        f"{str(exc).strip().splitlines()[0]}") from exc
    params = dict(model.named_parameters(remove_duplicate=False))
    if emb not in params or hd not in params:
        raise CkptError(f"--evaluate {spec}: the model has no parameter "
                        f"{emb if emb not in params else hd!r}")
    if untie and params[emb] is params[hd]:
        # the original holds two matrices: give the head its own so the model computes them
        owner = model.get_submodule(hd.rpartition(".")[0])
        owner.weight = nn.Parameter(tensors[hd].detach().clone())
    # load_state_dict wrote both names into a tying model's one Parameter, the head last (the
    # key-order bug): the embedding is set from its own tensor, the head as given
    with torch.no_grad():
        dict(model.named_parameters(remove_duplicate=False))[emb].copy_(tensors[emb])
    return model


def _loss(model: nn.Module, windows: torch.Tensor) -> float:
    import torch
    from torch.nn import functional as F

    model = model.double().eval()
    with torch.no_grad():
        out = model(windows[:, :-1])
        logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
        if logits.shape[-1] <= int(windows.max()):
            raise CkptError(f"--tokens: token id {int(windows.max())} is outside the model's "
                            f"vocabulary of {logits.shape[-1]}")
        return float(F.cross_entropy(logits.to(torch.float64).reshape(-1, logits.shape[-1]),
                                     windows[:, 1:].reshape(-1)))


def evaluate(ckpt: Checkpoint, spec: str, tokens: torch.Tensor, tolerance: float = 0.0,
             config: dict[str, Any] | None = None, embedding: str | None = None,
             head: str | None = None) -> list[tuple[str, float | None]]:
    """Mean cross-entropy (float64) of the original and of each policy's tied model."""
    report = inspect(ckpt, config, embedding, head)
    emb, hd = report["pairs"][0]["embedding"], report["pairs"][0]["head"]
    untied = convert(ckpt, "untied", "input", tolerance, config, emb, hd)
    model = _load_into(spec, untied.tensors, emb, hd, untie=True)
    windows = _windows(tokens, model)
    if int(windows.min()) < 0:
        raise CkptError(f"--tokens: negative token id {int(windows.min())}")
    rows: list[tuple[str, float | None]] = [("original", _loss(model, windows))]
    for policy in POLICIES:
        conv = convert(ckpt, "tied", policy, tolerance, config, emb, hd)
        if conv.refused:
            rows.append((policy, None))
            continue
        rows.append((policy, _loss(_load_into(spec, conv.tensors, emb, hd, untie=False),
                                   windows)))
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
    c.add_argument("--tolerance", type=float, default=0.0, metavar="T",
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


def _run_inspect(args: argparse.Namespace) -> int:
    if args.json:
        usable_output("--json", args.json)
        check_distinct({"FILE": args.file, "--json": args.json})
    config = _read_config(args.config) if args.config else None
    report = inspect(load(args.file), config, args.embedding, args.head)
    print(render(report))
    if args.json:
        atomic_write(args.json, json.dumps(report, indent=2) + "\n")
    pair = report["pairs"][0]
    bad = pair["state"].endswith("-missing") or pair["config_agrees"] is False
    return EXIT_WRONG if bad else EXIT_OK


def _run_convert(args: argparse.Namespace) -> int:
    out = usable_output("OUT", args.output)
    fmt = _out_format(out)
    ckpt_in = args.input
    if args.evaluate is not None and args.tokens is None or \
            args.tokens is not None and args.evaluate is None:
        raise CkptError("--evaluate TARGET and --tokens FILE go together")
    config = _read_config(args.config) if args.config else None
    ckpt = load(ckpt_in)
    inputs = {"IN": ckpt_in, **{f"IN shard {i}": f for i, f in enumerate(ckpt.files)}}
    if args.config:
        inputs["--config"] = args.config
    for name, path in inputs.items():
        if absolute(path) == out:
            raise CkptError(f"OUT {args.output!r} is the same file as {name} {path!r}: "
                            f"convert never overwrites its input; give another OUT")
    config_out = None
    if config is not None:
        config_out = usable_output("--config-out", args.config_out or os.path.join(
            os.path.dirname(out), "config.json"))
        if config_out == absolute(args.config):
            raise CkptError(f"--config-out {config_out!r} is the input config: give "
                            f"--config-out another file (the input is never overwritten)")
        check_distinct({"OUT": out, "--config-out": config_out})
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
    try:
        _write(converted, out, fmt, tie)
        if config is not None and config_out is not None:
            config = dict(config)
            config["tie_word_embeddings"] = args.to == "tied"
            if isinstance(config.get("text_config"), dict):
                config["text_config"] = {**config["text_config"],
                                         "tie_word_embeddings": args.to == "tied"}
            atomic_write(config_out, json.dumps(config, indent=2) + "\n")
    except OSError as exc:
        raise CkptError(f"OUT {args.output}: cannot be written ({exc.strerror or exc})") from exc
    stored = len(converted.tensors) - (1 if tie is not None and fmt == "safetensors" else 0)
    print(f"wrote {args.output} ({args.to}, policy {converted.metadata['tyingspec.policy']}, "
          f"{stored} tensors)" + (f"; config {config_out}" if config_out else ""))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Dispatch ``tyingspec ckpt inspect|convert``; bad input is a message and exit 2."""
    try:
        if args.ckpt_command == "inspect":
            return _run_inspect(args)
        if args.ckpt_command == "convert":
            return _run_convert(args)
    except (CkptError, OutputError) as exc:
        print(f"tyingspec ckpt: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print("tyingspec ckpt: expected a subcommand, inspect or convert", file=sys.stderr)
    return EXIT_USAGE
