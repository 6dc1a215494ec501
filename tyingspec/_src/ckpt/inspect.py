"""``tyingspec ckpt inspect``: is the pair one tensor, equal, or two matrices, and what does
the config say."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from tyingspec._src.ckpt.read import (
    Checkpoint,
    CkptError,
    config_says_tied,
    find_pairs,
    recorded_ties,
    same_storage,
)

if TYPE_CHECKING:
    import torch

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
    """The tie's state in ``ckpt`` as a JSON-ready dict (see the README for its fields): one
    entry of ``pairs`` per tied pair (:func:`~ckpt.read.find_pairs`), the embedding/head pair
    first."""
    config_ties = config_says_tied(config) if config is not None else None
    pairs = [_pair(ckpt, emb, hd, origin, config_ties)
             for emb, hd, origin in find_pairs(ckpt, config, embedding, head)]
    return {"schema": "tyingspec.ckpt/1", "file": ckpt.path, "format": ckpt.format,
            "files": ckpt.files, "tensors": len(ckpt.tensors),
            "metadata": {k: v for k, v in ckpt.metadata.items() if k.startswith("tyingspec.")},
            "pairs": pairs}


def _pair(ckpt: Checkpoint, emb: str | None, hd: str | None, origin: str | None,
          config_ties: bool | None) -> dict[str, Any]:
    """One pair's report: its state, how far apart, what the config says."""
    e = ckpt.tensors.get(emb) if emb is not None else None
    h = ckpt.tensors.get(hd) if hd is not None else None
    notes: list[str] = []
    if origin is not None:
        notes.append(f"tied pair declared by {origin}: {hd!r} is tied to {emb!r}")
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
        if same_storage(e, h):
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
    return pair


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs in the same places count as equal)."""
    import torch

    return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def render(report: dict[str, Any]) -> str:
    """The inspect report as text."""
    lines = [f"{report['file']} ({report['format']}, {report['tensors']} tensors"
             + (f", {len(report['files'])} shards" if len(report["files"]) > 1 else "") + ")"]
    for i, p in enumerate(report["pairs"]):
        if len(report["pairs"]) > 1:
            lines.append(f"  pair {i + 1} of {len(report['pairs'])}:")
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
