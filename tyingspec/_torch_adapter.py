"""The torch kind's call: one batch through a user's ``nn.Module``, everything observed.

Runs in the worker, where the user's code runs.  What it hands back is plain data: the tied
Parameter's own gradient (``dE``), what was observed at the tie's two uses (the reference is
built from it in the main process) and one :class:`~tyingspec._findings.Finding` per check
beyond rows.  Every gradient is taken on a float64 deep copy in ``eval()`` mode (dropout off,
so two passes are comparable); the user's module object is never edited.

The reference does not trust the model's backward at either use: forward hooks on the module
owning each use record ``dx`` (the gradient reaching the embedding's output) and ``h``, ``g``
(the head's input and the gradient reaching its output), so the input path is the scatter-add
of ``dx`` (minus ``padding_idx`` positions, the model's own semantics) and the output path is
``g.T @ h``.  When a use is not a plain lookup or linear map the hooks cannot vouch for it and
the paths come from ``torch.func.functional_call(..., tie_weights=False)`` instead (the
model's own backward of each use, checked against the forward by directional differences).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._adapters import AdapterError, Returned
from ._diagnosis import Label
from ._findings import Finding, failed, not_applicable, passed
from ._torch_model import Tie, as_target, build_model, describe, loss_function, owner
from ._torch_target import TorchTarget

#: The checks one call can run; a property asks for its own, ``tyingspec check`` for all.
CHECKS = ("identity", "optimizer", "gradient", "forward", "fresh", "micro_batches")

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

#: Identity and optimizer findings per target, run once per worker: they do not depend on the
#: batch (each rebuilds the model from its factory), and they are the slow part of a call.
_STRUCTURAL: dict[tuple[str, str], list[Finding]] = {}

_U64 = float(np.finfo(np.float64).eps) / 2


def _close(a: np.ndarray, e: np.ndarray, count: int) -> bool:
    """float64 agreement of two gradients summed over ``count`` terms in different orders:
    atol from the largest entry, rtol from the entry itself, both ~ count * u."""
    scale = float(np.abs(e).max(initial=0.0))
    rtol = 8 * _U64 * count
    return bool(np.all(np.abs(a - e) <= rtol * scale + rtol * np.abs(e) + 1e-300))


def _numpy(t: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(shape)
    return np.asarray(t.detach().to(torch.float64).cpu().numpy(), dtype=np.float64).copy()


def call_torch(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the model (``inputs["mode"] == "describe"``) or observe it on a batch."""
    # the models a check builds are small: one thread avoids the cost of waking a pool per
    # operation (seen: 3 s against 0.05 s per call on a busy 2-core machine)
    torch.set_num_threads(1)
    target = as_target(spec, fn)
    seed = int(inputs.get("seed", 0))
    model = build_model(spec, target, seed)
    tie, found = describe(spec, model, target)
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), "float64", evidence={"tie": asdict(tie)},
                        findings=(found,))
    B = tie.batch_size
    tokens = np.asarray(inputs["tokens"], dtype=np.int64)
    targets = np.asarray(inputs["targets"], dtype=np.int64)
    if tokens.size % B:
        raise AdapterError(spec, "the batch does not split into the model's batch size",
                           key="tokens", expected=f"a multiple of {B} tokens",
                           got=f"{tokens.size} tokens")
    t = torch.from_numpy(tokens.reshape(B, -1).copy())
    y = torch.from_numpy(targets.reshape(B, -1).copy())
    loss_of = _scalar(spec, loss_function(target, tie))
    checks = tuple(inputs.get("checks", CHECKS))
    findings: list[Finding] = [found]
    if found.failed:  # no tie: nothing to keep identical, and two tensors for the optimizer
        checks = tuple(c for c in checks if c not in ("identity", "optimizer"))
    for group in ("identity", "optimizer"):
        if group in checks:
            findings += _structural(spec, target, seed, tie, group, loss_of, t, y)
    base = copy.deepcopy(model).to(torch.float64).eval()
    evidence, own, loss = _observe_paths(spec, base, tie, loss_of, t, y)
    if evidence["observed_by"] != "hooks":
        findings.append(not_applicable(
            "gradient by path", "the tied gradient is the input path's scatter-add of dx plus "
            "the output path's g.T @ h, row by row",
            "a use of the tied weight is not a plain nn.Embedding lookup or linear head module "
            "(a custom autograd.Function or a direct read of the weight), so dx, h and g cannot "
            "be observed; the tied gradient is checked against the forward instead"))
    if "forward" in checks:
        findings.append(_against_forward(base, tie, loss_of, t, y, own, seed,
                                         bool(evidence.get("input_reached", True))))
    if "fresh" in checks:
        findings.append(_fresh(base, tie, loss_of, t, y, own))
    if "micro_batches" in checks:
        findings.append(_micro_batches(base, tie, loss_of, t, y, own))
    evidence["tie"] = asdict(tie)
    return Returned(own, (), "float64", loss=loss, evidence=evidence, findings=tuple(findings))


def _structural(spec: str, target: TorchTarget, seed: int, tie: Tie, group: str,
                loss_of: Loss, t: torch.Tensor, y: torch.Tensor) -> list[Finding]:
    """The identity or the optimizer findings of a target, computed once per worker."""
    key = (spec, group)
    if key not in _STRUCTURAL:
        from ._torch_identity import identity_findings, optimizer_findings

        def factory() -> nn.Module:
            return build_model(spec, target, seed)

        def loss_at(m: nn.Module) -> torch.Tensor:
            return loss_of(m, t, y)

        _STRUCTURAL[key] = identity_findings(
            factory, tie.embedding, tie.head, retie=target.retie, loss_of=loss_at) \
            if group == "identity" else optimizer_findings(
                factory, tie.embedding, tie.head, optimizer=target.optimizer, loss_of=loss_at)
    return _STRUCTURAL[key]


def _scalar(spec: str, loss_of: Loss) -> Loss:
    """``loss_of`` that names the target when the model's loss is not a scalar tensor (every
    check, identity and optimizer included, takes its loss through it)."""
    def checked(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(m, t, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise AdapterError(spec, "the loss is not a scalar tensor",
                               expected="a 0-dim tensor", got=repr(loss)[:80])
        return loss
    return checked


def _backward(m: nn.Module, loss_of: Loss, t: torch.Tensor, y: torch.Tensor,
              scale: float = 1.0) -> torch.Tensor:
    loss = loss_of(m, t, y)
    (loss * scale).backward()  # type: ignore[no-untyped-call]
    return loss


def _grad(m: nn.Module, tie: Tie) -> np.ndarray:
    return _numpy(m.get_parameter(tie.embedding).grad, (tie.vocab, tie.width))


def _observe_paths(spec: str, base: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor,
                   y: torch.Tensor) -> tuple[dict[str, Any], np.ndarray, float]:
    """The model's own tied gradient, and dx, h, g recorded at the two uses."""
    m = copy.deepcopy(base)
    emb_mod, head_mod = owner(m, tie.embedding), owner(m, tie.head)
    E = m.get_parameter(tie.embedding)
    seen: dict[str, list[Any]] = {"ids": [], "x": [], "dx": [], "h": [], "out": [], "g": []}

    def on_embedding(_mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad and args:
            seen["ids"].append(args[0].detach().reshape(-1))
            seen["x"].append(out.detach().reshape(-1, out.shape[-1]))
            slot = len(seen["x"]) - 1
            out.register_hook(  # type: ignore[no-untyped-call]
                lambda g, s=slot: _store(seen["dx"], s, g))

    def on_head(_mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad and args:
            seen["h"].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            seen["out"].append(out.detach().reshape(-1, out.shape[-1]))
            slot = len(seen["out"]) - 1
            out.register_hook(  # type: ignore[no-untyped-call]
                lambda g, s=slot: _store(seen["g"], s, g))

    handles = [emb_mod.register_forward_hook(on_embedding),
               head_mod.register_forward_hook(on_head)]
    try:
        m.zero_grad(set_to_none=True)
        loss = float(_backward(m, loss_of, t, y).detach())
    finally:
        for handle in handles:
            handle.remove()
    own = _grad(m, tie)
    W = E.detach()
    bias = getattr(head_mod, "bias", None)
    lookups = _usable_lookups(seen, W)
    heads = _usable_heads(seen, W, bias if isinstance(bias, torch.Tensor) else None)
    evidence: dict[str, Any] = {"observed_by": "hooks"}
    if lookups is not None and heads is not None:
        ids, dx = lookups
        if tie.padding_idx is not None:
            dx[ids == tie.padding_idx] = 0.0  # nn.Embedding(padding_idx=p): model semantics
        h, g = heads
        evidence.update(tokens=ids, dx=dx, h=h, g=g)
    else:
        evidence.update(_untied_split(base, tie, loss_of, t, y))
    return evidence, own, loss


def _store(slots: list[Any], slot: int, g: torch.Tensor) -> None:
    while len(slots) <= slot:
        slots.append(None)
    slots[slot] = g.detach().reshape(-1, g.shape[-1])


def _usable_lookups(seen: dict[str, list[Any]], W: torch.Tensor,
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, dx) when every recorded call of the embedding module was a plain lookup W[ids]
    and every one received a gradient."""
    if not seen["x"] or len(seen["dx"]) != len(seen["x"]) or any(g is None for g in seen["dx"]):
        return None
    for ids, x in zip(seen["ids"], seen["x"]):
        if ids.dtype not in (torch.int64, torch.int32) or x.shape[-1] != W.shape[1] or \
                not torch.allclose(x, W[ids.long()], rtol=1e-12, atol=1e-12):
            return None
    ids = torch.cat([i.long() for i in seen["ids"]]).numpy().copy()
    dx = torch.cat(seen["dx"]).to(torch.float64).numpy().copy()
    return ids, dx


def _usable_heads(seen: dict[str, list[Any]], W: torch.Tensor, bias: torch.Tensor | None,
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """(h, g) when every recorded call of the head module computed h @ W.T (+ bias)."""
    if not seen["out"] or len(seen["g"]) != len(seen["out"]) or any(g is None for g in seen["g"]):
        return None
    for h, out in zip(seen["h"], seen["out"]):
        if h.shape[-1] != W.shape[1] or out.shape[-1] != W.shape[0]:
            return None
        expect = F.linear(h.to(W.dtype), W, bias)
        if not torch.allclose(out, expect, rtol=1e-10, atol=1e-10 * float(expect.abs().max())):
            return None
    h = torch.cat(seen["h"]).to(torch.float64).numpy().copy()
    g = torch.cat(seen["g"]).to(torch.float64).numpy().copy()
    return h, g


def _untied_split(base: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor,
                  y: torch.Tensor) -> dict[str, Any]:
    """Each use's gradient from the model's own backward, the uses handed separate copies."""
    from torch.func import functional_call

    E = base.get_parameter(tie.embedding).detach()
    E_in = E.clone().requires_grad_(True)
    E_out = E.clone().requires_grad_(True)

    class Untied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = base

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return functional_call(base, {tie.embedding: E_in, tie.head: E_out}, args, kwargs,
                                   tie_weights=False)

    loss = loss_of(Untied(), t, y)
    d_in, d_out = torch.autograd.grad(loss, (E_in, E_out), allow_unused=True)
    shape = (tie.vocab, tie.width)
    # d_in None: the lookup never reaches E through autograd (a detached read, or a custom
    # Function that writes .grad itself); the same for d_out
    return {"observed_by": "functional_call", "dE_in": _numpy(d_in, shape),
            "dE_out": _numpy(d_out, shape), "input_reached": d_in is not None,
            "output_reached": d_out is not None}


def _against_forward(base: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor,
                     y: torch.Tensor, own: np.ndarray, seed: int,
                     input_reached: bool = True) -> Finding:
    from ._localize import BudgetExceeded, localize

    check = "gradient against the forward"
    invariant = ("the tied gradient agrees with directional central differences of the "
                 "loss (float64), row sets split until the disagreeing rows are found")
    m = copy.deepcopy(base)
    E = m.get_parameter(tie.embedding)

    def loss_along(rows: np.ndarray, D: np.ndarray, step: float) -> float:
        idx = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        with torch.no_grad():
            saved = E[idx].clone()
            E[idx] = saved + step * torch.from_numpy(np.asarray(D, dtype=np.float64))
            try:
                return float(loss_of(m, t, y))
            finally:
                E[idx] = saved

    rows = np.arange(tie.vocab)
    pad = tie.padding_idx
    if pad is not None and np.any(tokens_of(t) == pad):
        # padding_idx: the forward reads row p at padding positions, the backward skips that
        # use by design; its directional derivative is not the model's gradient there
        rows = rows[rows != pad]
    try:
        budget = fd_budget(tie.vocab)
        found = localize(loss_along, own, seed=seed, rows=rows, max_evaluations=budget)
    except BudgetExceeded as exc:
        # many wrong rows: the rows confirmed so far, and how many are left undecided
        label, why = _pattern(list(exc.found), tokens_of(t), tie, input_reached, partial=True)
        return failed(check, invariant, label,
                      f"rows {list(exc.found)[:16]} (and {exc.unresolved} rows not yet "
                      f"decided) disagree with the forward{why} (stopped at the budget of "
                      f"{budget} forward evaluations)", budget)
    if not found.wrong_rows:
        return passed(check, invariant, f"{found.evaluations} forward evaluations",
                      found.evaluations)
    label, why = _pattern(list(found.wrong_rows), tokens_of(t), tie, input_reached)
    return failed(check, invariant, label,
                  f"rows {list(found.wrong_rows)[:16]} disagree with the forward{why} "
                  f"({found.evaluations} forward evaluations)", found.evaluations)


def tokens_of(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.reshape(-1).numpy(), dtype=np.int64)


def fd_budget(V: int) -> int:
    """Forward evaluations one localisation may spend: k wrong rows cost ~12 k log2 V, so this
    localises about five rows at any V and stops, with what it found, beyond that (a bug on
    every row needs no more rows to be named)."""
    return int(200 + 60 * np.log2(max(V, 2)))


def _pattern(wrong: list[int], tokens: np.ndarray, tie: Tie,
             input_reached: bool, *, partial: bool = False) -> tuple[Label, str]:
    """Name rows found wrong by the forward alone from where they sit in the batch: the
    catalogue's patterns (the rows of repeated tokens, every present row, the padding row)."""
    counts = np.bincount(tokens, minlength=tie.vocab)
    present = {int(v) for v in np.flatnonzero(counts)}
    repeated = {int(v) for v in np.flatnonzero(counts > 1)}
    rows = set(wrong)
    if tie.padding_idx is not None and rows == {tie.padding_idx}:
        return "padding_row_masked", (f": row {tie.padding_idx} is padding_idx, whose output "
                                      "path is masked too")
    if (rows == present or partial and rows <= present) and rows and not input_reached:
        return "input_path_missing", (": present rows only, and the lookup never reaches E "
                                      "through autograd")
    if repeated and rows <= repeated:
        return "duplicates_not_accumulated", ": exactly rows of tokens seen more than once"
    if rows == present:
        return "input_path_wrong", ": exactly the rows of tokens in the batch"
    return "gradient_disagrees_with_forward", ""


def _fresh(base: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor, y: torch.Tensor,
           own: np.ndarray) -> Finding:
    check = "fresh gradient"
    invariant = "two backward passes, each after zero_grad(), give the same gradient"
    m = copy.deepcopy(base)
    grads = []
    for _ in range(2):
        m.zero_grad()
        _backward(m, loss_of, t, y)
        grads.append(_grad(m, tie))
    count = int(t.numel()) * tie.width + tie.vocab
    if _close(grads[1], grads[0], count):
        return passed(check, invariant)
    if _close(grads[1] - grads[0], grads[0], count):
        return failed(check, invariant, "gradient_not_zeroed",
                      "the second pass returned the first pass's gradient plus its own: a "
                      "buffer behind the tied gradient survives zero_grad()")
    return failed(check, invariant, "unknown", "the two passes differ (not by the first pass): "
                  "the backward is not deterministic in eval() mode")


def _micro_batches(base: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor,
                   y: torch.Tensor, own: np.ndarray) -> Finding:
    check = "micro-batches accumulate"
    invariant = ("k micro-batches, each backward of loss / k, sum to the gradient of one batch "
                 "holding them all")
    k = int(t.shape[0])
    if k < 2:
        return not_applicable(check, invariant, "the batch has one sequence (batch_size=1)")
    m = copy.deepcopy(base)
    m.zero_grad()
    for i in range(k):
        _backward(m, loss_of, t[i:i + 1], y[i:i + 1], 1.0 / k)
    total = _grad(m, tie)
    count = int(t.numel()) * tie.width + tie.vocab
    if _close(total, own, count):
        return passed(check, invariant, f"k = {k}")
    last = copy.deepcopy(base)
    last.zero_grad()
    _backward(last, loss_of, t[k - 1:], y[k - 1:], 1.0 / k)
    if _close(total, _grad(last, tie), count):
        return failed(check, invariant, "gradient_assigned",
                      f"after {k} micro-batches the tied gradient is the last one's alone: "
                      "the gradient is assigned (`.grad =`), not added, so earlier "
                      "micro-batches are lost")
    return failed(check, invariant, "unknown",
                  f"{k} micro-batches do not sum to the whole batch's gradient")

