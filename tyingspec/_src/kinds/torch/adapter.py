"""The torch kind's call: one batch through a user's ``nn.Module``, everything observed.

Runs in the worker, where the user's code runs.  What it hands back is plain data: the tied
Parameter's own gradient (``dE``), what was observed at the tie's uses (the reference is built
from it in the main process) and one :class:`~core.findings.Finding` per check beyond
rows.

A check runs the path that trains: every model is rebuilt from the target's factory (never
deep-copied), in the dtype it trains in (or the ``--precision`` asked for, where it converts),
in ``train()`` mode with every dropout probability set to 0 and torch's generator reseeded
before each pass, with the model's own loss (``labels=``, ``targets``) and the target's
``after_backward``.  Its gradient is judged at its own precision, with the same bounds as the
other kinds.

The reference does not trust the model's backward at either use: every use of the tied
Parameter is observed where torch dispatches it (see :mod:`kinds.torch.uses`), so the
input path is the scatter-add of each lookup's ``dx`` (under torch's semantics for the lookup's
``padding_idx`` and ``scale_grad_by_freq``) and the output path is ``g.T @ h`` over every head.
When a use cannot be observed (a custom ``autograd.Function``, a detached read, an operation
the observer does not know), the paths come from ``torch.func.functional_call(...,
tie_weights=False)`` instead (the model's own backward of each use), and the verdict rests on
the forward check: directional differences of the loss, in float64 where the model converts,
at the precision its loss is really computed at otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tyingspec._src.core.adapters import AdapterError, Returned, model_batch
from tyingspec._src.core.diagnosis import forward_pattern
from tyingspec._src.core.findings import Finding, failed, not_applicable, passed, uses_unobserved
from tyingspec._src.core.process_state import torch_state_kept
from tyingspec._src.core.tolerance import Precision, precision_of
from tyingspec._src.kinds.torch.discover import (
    Tie,
    as_target,
    build_model,
    declared_ints,
    describe,
    loss_function,
    model_sources,
    owner,
)
from tyingspec._src.kinds.torch.target import TorchTarget

if TYPE_CHECKING:
    from tyingspec._src.kinds.torch.uses import Uses

#: The checks one call can run; a property asks for its own, ``tyingspec check`` for all.
CHECKS = ("identity", "optimizer", "gradient", "forward", "fresh", "micro_batches", "steps")

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

#: Identity and optimizer findings per target, run once per worker: they do not depend on the
#: batch (each rebuilds the model from its factory), and they are the slow part of a call.
_STRUCTURAL: dict[tuple[str, str], list[Finding]] = {}

_U64 = float(np.finfo(np.float64).eps) / 2


def _numpy(t: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(shape)
    return np.asarray(t.detach().to(torch.float64).cpu().numpy(), dtype=np.float64).copy()


def call_torch(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the model (``inputs["mode"] == "describe"``) or observe it on a batch; the
    process's torch state is as it was afterwards (see :mod:`core.process_state`)."""
    from tyingspec._src.kinds.torch.uses import TorchUnsupported

    with torch_state_kept():
        try:
            return _call(spec, fn, inputs)
        except TorchUnsupported as exc:
            raise AdapterError(spec, "cannot be checked on this torch", got=str(exc),
                               expected="a torch release tyingspec's CI runs (see the "
                                        "README's install section)") from exc


def _call(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    # the models a check builds are small: one thread avoids the cost of waking a pool per
    # operation (seen: 3 s against 0.05 s per call on a busy 2-core machine)
    torch.set_num_threads(1)
    target = as_target(spec, fn)
    seed = int(inputs.get("seed", 0))
    build = Build(spec, target, seed, str(inputs.get("precision", "auto")))
    model = build.fresh()
    tie, found = describe(spec, model, target)
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), build.precision, evidence={"tie": asdict(tie)},
                        findings=(found,))
    tokens, targets = model_batch(spec, inputs, tie.batch_size, tie.vocab)
    t, y = torch.from_numpy(tokens), torch.from_numpy(targets)
    raw_loss = loss_function(target, tie)
    loss_of = _scalar(spec, raw_loss, seed, target.after_backward)
    checks = tuple(inputs.get("checks", CHECKS))
    findings: list[Finding] = [found]
    if found.failed:  # no tie: nothing to keep identical, and two tensors for the optimizer
        checks = tuple(c for c in checks if c not in ("identity", "optimizer"))
    for group in ("identity", "optimizer"):
        if group in checks:
            findings += _structural(spec, target, seed, tie, group, loss_of, t, y)
    evidence, own, loss = _observe_paths(build, model, tie, loss_of, t, y)
    unit = _unit(build.dtype)
    if evidence["observed_by"] != "uses":
        findings.append(uses_unobserved(
            f"a use of the tied weight cannot be observed ({evidence['why']}), so dx, h and g "
            "cannot be vouched for; the tied gradient is checked against the forward instead"))
    if tie.padding_idx is not None:
        findings.append(_padding_row(model, tie, frozenset(
            _reads(model, evidence, t, y).tolist())))
    if tie.convention in ("labels", "targets"):
        findings.append(_own_loss(build, tie, t, y))
    if "forward" in checks:
        findings.append(_against_forward(build, tie, loss_of, t, y, own, seed,
                                         bool(evidence.get("input_reached", True)),
                                         _reads(model, evidence, t, y),
                                         _power_probe(build, evidence, tie)))
    if "fresh" in checks:
        findings.append(_fresh(build, tie, loss_of, t, y, unit))
    if "micro_batches" in checks:
        # the same loss under another generator seed: a forward that draws random numbers
        # (a router's sampling) is told from a micro-batch bug by it
        reseeded = _scalar(spec, raw_loss, seed + _OTHER_SEED, target.after_backward)
        findings.append(_micro_batches(build, tie, loss_of, t, y, own, unit, reseeded) if not
                        tie.scale_grad_by_freq else not_applicable(
                            "micro-batches accumulate", _MICRO,
                            "nn.Embedding(scale_grad_by_freq=True) divides by each token's "
                            "count within a call, so micro-batches rightly differ from one "
                            "batch"))
    if "steps" in checks:
        findings.append(_training_steps(build, target, tie, loss_of, t, y, seed,
                                        bool(evidence.get("input_reached", True))))
    evidence["tie"] = asdict(tie)
    return Returned(own, (), build.precision, loss=loss, evidence=evidence,
                    findings=tuple(findings))


class Build:
    """Fresh models from the target's factory, as the user trains them: in the model's own
    dtype (or the one asked for, where the model converts), in ``train()`` mode with every
    dropout probability set to 0 (``nn.Dropout`` modules and the ``*dropout*``/``*pdrop*``
    floats that transformers' attention reads), so that two passes are comparable.  Each
    model is built anew, never deep-copied: a deep copy keeps closures over the original
    module (minGPT's ``Block.mlpf`` lambda), and the checks must see the user's own model."""

    def __init__(self, spec: str, target: TorchTarget, seed: int, precision: str) -> None:
        self.spec, self.target, self.seed = spec, target, seed
        self.asked = precision if precision in _DTYPES else None
        self.dtype: torch.dtype | None = None  # the dtype the model trains in, once known

    @property
    def precision(self) -> Precision:
        return precision_of(str(self.dtype or torch.float64).removeprefix("torch."))

    def fresh(self, dtype: torch.dtype | None = None) -> nn.Module:
        model = build_model(self.spec, self.target, self.seed)
        want = dtype or (_DTYPES[self.asked] if self.asked else None)
        if want is not None:
            try:
                model = model.to(want)
            except Exception:  # noqa: BLE001  (a model that cannot convert keeps its own)
                if dtype is not None:
                    raise
        if self.dtype is None:
            self.dtype = _float_dtype(model)
        _train_without_dropout(model)
        return model


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of the model's parameters hold (what it trains in)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda k: counts[k]) if counts else torch.float32


def _train_without_dropout(model: nn.Module) -> None:
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and _is_dropout(name):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and value and _is_dropout(name):
                try:
                    setattr(config, name, 0.0)
                except Exception:  # noqa: BLE001  (a frozen config: its modules were zeroed)
                    pass


def _is_dropout(name: str) -> bool:
    low = name.lower()
    return "dropout" in low or "pdrop" in low or low.endswith("_drop") or "drop_path" in low


def _unit(dtype: torch.dtype | None) -> float:
    return float(torch.finfo(dtype or torch.float64).eps) / 2


def _structural(spec: str, target: TorchTarget, seed: int, tie: Tie, group: str,
                loss_of: Loss, t: torch.Tensor, y: torch.Tensor) -> list[Finding]:
    """The identity or the optimizer findings of a target, computed once per worker."""
    key = (spec, group)
    if key not in _STRUCTURAL:
        from tyingspec._src.kinds.torch.identity import identity_findings, optimizer_findings

        def factory() -> nn.Module:
            return build_model(spec, target, seed)

        def loss_at(m: nn.Module) -> torch.Tensor:
            return loss_of(m, t, y)

        _STRUCTURAL[key] = identity_findings(
            factory, tie.embedding, tie.head, retie=target.retie, loss_of=loss_at) \
            if group == "identity" else optimizer_findings(
                factory, tie.embedding, tie.head, optimizer=target.optimizer, loss_of=loss_at,
                spec=spec)
    return _STRUCTURAL[key]


def _scalar(spec: str, loss_of: Loss, seed: int,
            after_backward: Callable[[nn.Module], None] | None) -> Loss:
    """``loss_of`` that reseeds torch's generator before every pass (so a dropout the check
    could not switch off draws the same masks each time), names the target when the model's
    loss is not a finite scalar tensor (every check, identity and optimizer included, takes
    its loss through it), and runs the target's ``after_backward`` once the loss's backward
    has run."""
    def checked(m: nn.Module, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed + 1)
        try:
            loss = loss_of(m, t, y)
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(spec, "the model's forward raised", key="forward",
                               got=f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise AdapterError(spec, "the loss is not a scalar tensor",
                               expected="a 0-dim tensor", got=repr(loss)[:80])
        if after_backward is not None and loss.requires_grad:
            # the user's own model, also when the check calls it through a wrapper
            user = m.inner if isinstance(m, _Untied) else m
            loss.register_hook(  # type: ignore[no-untyped-call]
                lambda g: _after(user, after_backward))
        return loss
    return checked


def _after(model: nn.Module, after_backward: Callable[[nn.Module], None]) -> None:
    # a hook on the loss fires first in its backward; what must run after the whole backward
    # is queued on the autograd engine's final callbacks
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(lambda: after_backward(model))


def _backward(m: nn.Module, loss_of: Loss, t: torch.Tensor, y: torch.Tensor,
              scale: float = 1.0) -> torch.Tensor:
    loss = loss_of(m, t, y)
    (loss * scale).backward()  # type: ignore[no-untyped-call]
    return loss


def _grad(m: nn.Module, tie: Tie) -> np.ndarray:
    return _numpy(m.get_parameter(tie.embedding).grad, (tie.vocab, tie.width))


def _observe_paths(build: Build, m: nn.Module, tie: Tie, loss_of: Loss, t: torch.Tensor,
                   y: torch.Tensor) -> tuple[dict[str, Any], np.ndarray, float]:
    """The model's own tied gradient, and dx, h, g recorded at every use of the tied
    Parameter (see :mod:`kinds.torch.uses`)."""
    from tyingspec._src.kinds.torch.uses import observed_uses

    E = m.get_parameter(tie.embedding)
    m.zero_grad(set_to_none=True)
    with observed_uses(E) as uses:
        loss_t = loss_of(m, t, y)
    loss_t.backward()  # type: ignore[no-untyped-call]
    loss = float(loss_t.detach())
    own = _grad(m, tie)
    why = uses.problem()
    evidence: dict[str, Any] = {"least_precise": str(uses.least_precise).removeprefix("torch.")}
    if why is None:
        ids, dx, h, g = _observed(uses, tie)
        evidence.update(observed_by="uses", tokens=ids, dx=dx, h=h, g=g,
                        lookups=len(uses.lookups), heads=len(uses.heads))
        skipped = [u["pad_input"][1] for u in uses.lookups
                   if u.get("pad_input") is not None and u["pad_input"][0] == tie.padding_idx]
        if skipped:
            evidence["pad_input"] = np.sum(skipped, axis=0)
    else:
        evidence.update(_untied_split(build, tie, loss_of, t, y), why=why)
    return evidence, own, loss


_MEAN_CE = ("the model's own loss is the mean token cross-entropy of its own logits (causal "
            "or unshifted targets)")


def _loss_and_logits(m: nn.Module, tie: Tie, t: torch.Tensor, y: torch.Tensor,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The loss and the logits one call of the model's own convention returns."""
    extra: dict[str, Any] = {"use_cache": False} if tie.no_cache else {}
    if tie.convention == "labels":
        out = m(input_ids=t, labels=y, **extra)
    elif tie.targets_keyword:
        out = m(t, **{tie.targets_param or "targets": y}, **extra)
    else:
        out = m(t, y, **extra)
    parts = list(out) if isinstance(out, (tuple, list)) else [
        getattr(out, "loss", None), getattr(out, "logits", None)]
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    loss = next((p for p in tensors if p.dim() == 0), None)
    logits = next((p for p in tensors if p.dim() >= 2 and p.shape[-1] == tie.vocab), None)
    return loss, logits


def _own_loss(build: Build, tie: Tie, t: torch.Tensor, y: torch.Tensor) -> Finding:
    """The loss a model trains with is part of what is judged: a sum over tokens divided by
    the number of sequences (the class of transformers' 2024 gradient-accumulation bug)
    scales the gradient with it, and no row can show that, because both paths scale alike."""
    check = "loss is the mean token cross-entropy"
    m = build.fresh()
    torch.manual_seed(build.seed + 1)
    with torch.no_grad():
        try:
            loss, logits = _loss_and_logits(m, tie, t, y)
        except Exception as exc:  # noqa: BLE001  (the forward's own errors show elsewhere)
            return not_applicable(check, _MEAN_CE, f"the forward raised {exc!r}"[:200])
    if loss is None or logits is None or logits.shape[:-1] != y.shape:
        return not_applicable(check, _MEAN_CE, "the model returns no logits beside its loss")
    z = logits.detach().double()
    V = z.shape[-1]
    candidates = {"unshifted": F.cross_entropy(z.reshape(-1, V), y.reshape(-1)),
                  "causal": F.cross_entropy(z[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))}
    got = float(loss)
    u = _unit(loss.dtype if loss.is_floating_point() else None)
    atol = 64 * u * (1.0 + float(z.abs().max()))
    if any(abs(got - float(c)) <= atol + 64 * u * abs(float(c)) for c in candidates.values()):
        return passed(check, _MEAN_CE)
    B, T = (int(n) for n in y.shape)
    counts = {T: f"T = {T}", T - 1: f"T - 1 = {T - 1}", B: f"B = {B}", B * T: "B x T",
              1 / B: "1 / B", 1 / T: "1 / T"}
    for name, c in candidates.items():
        ratio = got / float(c) if float(c) else float("nan")
        for value, what in counts.items():
            if value != 1 and abs(ratio - value) <= 1e-3 * value:
                return failed(check, _MEAN_CE, "loss_misnormalised",
                              f"the loss is {ratio:.6g} x the mean {name} token cross-entropy "
                              f"of the model's own logits ({what}, for a batch of B = {B} "
                              f"sequences of T = {T}): a sum over tokens divided by the number "
                              "of sequences, not of tokens, and the gradient is scaled with it")
    causal, unshifted = float(candidates["causal"]), float(candidates["unshifted"])
    return not_applicable(check, _MEAN_CE, f"the loss ({got:.6g}) is no count multiple of "
                          f"the mean token cross-entropy of its logits ({causal:.6g} causal, "
                          f"{unshifted:.6g} unshifted): an auxiliary term, "
                          "a weighting or smoothing; not judged (name the loss with "
                          "TorchTarget(loss=...) to have it checked)")


#: Where a model or its config names its padding token.
_PAD_KEYS = ("pad_token_id", "padding_idx", "pad_id", "pad_idx", "pad_token")


def _configs(model: nn.Module, vocab: int) -> list[Any]:
    """The model's config, its text config, and every config of the same vocabulary that a
    sub-config or a submodule holds.  A composite model (transformers' Gemma3, Fuyu, GOT-OCR2:
    a language model beside a vision tower) names its pad token in ``config.text_config`` and
    in its language model's own config, not on the top-level config (a sweep of transformers
    5.25's causal-LM architectures found six such false alarms)."""
    found: list[Any] = []

    def add(config: Any) -> None:
        if config is not None and not isinstance(config, (int, float, str, bool)) \
                and all(config is not seen for seen in found):
            found.append(config)

    top = getattr(model, "config", None)
    add(top)
    text = getattr(top, "get_text_config", None)
    if callable(text):
        try:
            add(text())
        except Exception:  # noqa: BLE001 - a config's own helper; the others still count
            pass
    same_vocab = [v for v in vars(top).values() if getattr(v, "vocab_size", None) == vocab] \
        if top is not None and hasattr(top, "__dict__") else []
    same_vocab += [m.config for m in model.modules()
                   if getattr(getattr(m, "config", None), "vocab_size", None) == vocab]
    for config in same_vocab:
        add(config)
    return found


def _declared_padding(model: nn.Module, vocab: int) -> set[int]:
    return set(declared_ints(model_sources(model, _configs(model, vocab)), _PAD_KEYS))


def _padding_row(model: nn.Module, tie: Tie, read: frozenset[int]) -> Finding:
    """A declared ``padding_idx`` that the batch reads as a real token, with nothing naming it
    the pad token (a config's ``pad_token_id``): token p's embedding never learns from its
    reads (padding_idx=0 on a vocabulary whose token 0 is real)."""
    check = "padding row"
    invariant = ("the lookup's padding_idx row is the pad token: named so by the model's "
                 "config, or never read as a real token")
    pad = int(tie.padding_idx or 0)
    if pad not in read:
        return not_applicable(check, invariant, f"no lookup in this batch reads row {pad}")
    if pad in _declared_padding(model, tie.vocab):
        return passed(check, invariant, f"row {pad} is the configured pad token")
    return failed(check, invariant, "padding_idx_on_real_token",
                  f"padding_idx={pad} skips the input path of token {pad}, which this batch "
                  "reads as a real token, and no config names it the pad token "
                  "(pad_token_id): its embedding never learns from its reads; drop "
                  "padding_idx, or name the pad token in the config")


def _reads(model: nn.Module, evidence: dict[str, Any], t: torch.Tensor,
           y: torch.Tensor) -> np.ndarray:
    """The ids the lookups read, with their multiplicity: observed, or, where the uses could
    not be observed, the tokens and, for an encoder-decoder, the decoder's inputs (the labels
    shifted right behind its start token, as transformers builds them)."""
    if evidence.get("observed_by") == "uses":
        return np.asarray(evidence["tokens"], dtype=np.int64)
    config = getattr(model, "config", None)
    start = getattr(config, "decoder_start_token_id", None)
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(start, int):
        return tokens_of(t)
    decoder = np.concatenate([np.full((y.shape[0], 1), start, dtype=np.int64),
                              y[:, :-1].numpy().astype(np.int64)], axis=1)
    return np.concatenate([tokens_of(t), decoder.reshape(-1)])


def _observed(uses: Uses, tie: Tie) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ids and dx of every lookup (see :func:`_input_rows`) and the h and g of every
    head, in float64: what the reference is built from."""
    ids, dx = _input_rows(uses.lookups, tie.vocab, tie.padding_idx)
    h = torch.cat([u["h"] for u in uses.heads]).to(torch.float64).numpy().copy()
    g = torch.cat([u["g"] for u in uses.heads]).to(torch.float64).numpy().copy()
    return ids, dx, h, g


def _input_rows(lookups: list[dict[str, Any]], V: int,
                declared: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ids and dx of every lookup, under torch's own semantics for the options it was
    called with: positions reading ``padding_idx`` add nothing, and ``scale_grad_by_freq``
    divides each position's gradient by its token's count in that call.  The embedding
    module's ``declared`` padding row is masked at every lookup: a forward that calls
    ``F.embedding`` without it skips the mask it declares (the pytorch #26302 family)."""
    all_ids, all_dx = [], []
    for u in lookups:
        ids = u["ids"].numpy().astype(np.int64)
        dx = u["dx"].to(torch.float64).numpy().copy()
        pad = u.get("padding_idx")
        pad = declared if pad is None else pad
        if pad is not None:
            pad = int(pad) + (V if int(pad) < 0 else 0)
            u["pad_input"] = (pad, dx[ids == pad].sum(axis=0))
            dx[ids == pad] = 0.0
        if u.get("scale_grad_by_freq"):
            dx /= np.bincount(ids, minlength=V)[ids][:, None]
        all_ids.append(ids)
        all_dx.append(dx)
    return np.concatenate(all_ids), np.concatenate(all_dx)


class _Untied(nn.Module):
    """The model called with each use's own copy of the tied weight (``functional_call``)."""

    def __init__(self, inner: nn.Module, given: dict[str, torch.Tensor],
                 call: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.given, self.call = inner, given, call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.inner, self.given, args, kwargs, tie_weights=False)


def _untied_split(build: Build, tie: Tie, loss_of: Loss, t: torch.Tensor,
                  y: torch.Tensor) -> dict[str, Any]:
    """Each use's gradient from the model's own backward, the uses handed separate copies:
    every name of the tied Parameter whose module reads rows gets one copy, every other name
    another."""
    from torch.func import functional_call

    base = build.fresh()
    E = base.get_parameter(tie.embedding).detach()
    names = [n for n, p in base.named_parameters(remove_duplicate=False)
             if p is base.get_parameter(tie.embedding)]
    E_in = E.clone().requires_grad_(True)
    E_out = E.clone().requires_grad_(True)
    given = {n: E_in if isinstance(owner(base, n), nn.Embedding) or n == tie.embedding else
             E_out for n in names}
    if tie.head not in names:  # two Parameters (a copy): the head's own name
        given[tie.head] = E_out

    loss = loss_of(_Untied(base, given, functional_call), t, y)
    d_in, d_out = torch.autograd.grad(loss, (E_in, E_out), allow_unused=True)
    shape = (tie.vocab, tie.width)
    # d_in None: the lookup never reaches E through autograd (a detached read, or a custom
    # Function that writes .grad itself); the same for d_out
    return {"observed_by": "functional_call", "dE_in": _numpy(d_in, shape),
            "dE_out": _numpy(d_out, shape), "input_reached": d_in is not None,
            "output_reached": d_out is not None}


def _power_probe(build: Build, evidence: dict[str, Any], tie: Tie) -> np.ndarray | None:
    """The input path, for the forward check to show it could tell it missing, where the
    rows may not: a low-precision model (its rounding bound can exceed a row), or uses that
    could not be observed (the rows then are the model's own)."""
    low = build.dtype in (torch.bfloat16, torch.float16)
    if evidence.get("observed_by") == "uses":
        if not low:
            return None
        dE_in = np.zeros((tie.vocab, tie.width))
        np.add.at(dE_in, evidence["tokens"], evidence["dx"])
        return dE_in
    return np.asarray(evidence["dE_in"], dtype=np.float64)


def _forward_model(build: Build, tie: Tie, loss_of: Loss, t: torch.Tensor,
                   y: torch.Tensor) -> tuple[nn.Module, float]:
    """The model the forward check differences, and the unit roundoff its loss is really
    computed at: a float64 build where the model converts and runs in float64 (central
    differences are far sharper there), else the model in the dtype it trains in."""
    from tyingspec._src.kinds.torch.uses import observed_uses

    for dtype in (torch.float64, None):
        try:
            m = build.fresh(dtype)
            E = m.get_parameter(tie.embedding)
            with torch.no_grad(), observed_uses(E) as uses:
                value = loss_of(m, t, y)
            if dtype is not None and not bool(torch.isfinite(value)):
                continue
            return m, _unit(uses.least_precise)
        except Exception:  # noqa: BLE001  (no float64 kernel: the model's own dtype)
            if dtype is None:
                raise
    raise AssertionError("unreachable")


def _against_forward(build: Build, tie: Tie, loss_of: Loss, t: torch.Tensor,
                     y: torch.Tensor, own: np.ndarray, seed: int,
                     input_reached: bool, reads: np.ndarray,
                     input_path: np.ndarray | None = None) -> Finding:
    """``reads``: the ids the lookups read (see :func:`_reads`).  ``input_path``: when given,
    a passing check is also run on the gradient without it, and has power when that one
    fails."""
    m, unit = _forward_model(build, tie, loss_of, t, y)
    return _differenced(m, unit, build.dtype, tie, loss_of, t, y, own, seed, input_reached,
                        reads, input_path, "gradient against the forward", _AGAINST)


_AGAINST = ("the tied gradient agrees with directional central differences of the loss, row "
            "sets split until the disagreeing rows are found")


def _differenced(m: nn.Module, unit: float, dtype: torch.dtype | None, tie: Tie, loss_of: Loss,
                 t: torch.Tensor, y: torch.Tensor, own: np.ndarray, seed: int,
                 input_reached: bool, reads: np.ndarray, input_path: np.ndarray | None,
                 check: str, invariant: str) -> Finding:
    """``own`` against directional differences of ``m``'s loss, whose rounding is ``unit``
    (``dtype``: what ``own`` was computed in)."""
    from tyingspec._src.core.localize import BudgetExceeded, fails_without, localize

    E = m.get_parameter(tie.embedding)
    e_scale = float(E.detach().double().std()) or 1.0

    def loss_along(rows: np.ndarray, D: np.ndarray, step: float) -> float:
        idx = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        with torch.no_grad():
            saved = E[idx].clone()
            E[idx] = (saved.double() + step * torch.from_numpy(
                np.asarray(D, dtype=np.float64))).to(E.dtype)
            try:
                return float(loss_of(m, t, y))
            finally:
                E[idx] = saved

    rows = np.arange(tie.vocab)
    pad = tie.padding_idx
    if pad is not None and np.any(reads == pad):
        # padding_idx: the forward reads row p wherever a lookup is handed p, the backward
        # skips that use by design; its directional derivative is not the model's gradient
        # there.  Where no lookup reads p, row p carries the output path alone and is checked.
        rows = rows[rows != pad]
    if tie.scale_grad_by_freq:
        # declared semantics too: a token read k times gets 1/k of its input path
        counts = np.bincount(reads, minlength=tie.vocab)
        rows = rows[counts[rows] <= 1]
    # the claimed gradient was rounded at the precision it was computed in, over sums of up
    # to one term per position and row
    grad_rtol = max(2.0**-40, 16 * _unit(dtype))
    budget = fd_budget(tie.vocab)
    try:
        found = localize(loss_along, own, seed=seed, rows=rows, max_evaluations=budget,
                         e_scale=e_scale, unit=unit, grad_rtol=grad_rtol)
    except BudgetExceeded as exc:
        # many wrong rows: the rows confirmed so far, and how many are left undecided
        label, why = forward_pattern(list(exc.found), reads, tie.vocab,
                                     padding_idx=tie.padding_idx,
                                     input_reached=input_reached, partial=True)
        return failed(check, invariant, label,
                      f"rows {list(exc.found)[:16]} (and {exc.unresolved} rows not yet "
                      f"decided) disagree with the forward{why} (stopped at the budget of "
                      f"{budget} forward evaluations)", budget)
    at = f"loss at unit roundoff {unit:.2g}"
    if not found.wrong_rows:
        if found.worst > 1:
            # a set disagreed and no single row could be confirmed: what was seen to disagree
            # is never cleared by the sets that agreed after it
            # a label only from evidence beyond the rows: autograd shows no input path
            label = "gradient_disagrees_with_forward" if input_reached else \
                "input_path_missing"
            why = "" if input_reached else (", and the lookup never reaches E through "
                                            "autograd")
            return failed(check, invariant, label,
                          f"a set of rows disagreed with the forward ({found.worst:.3g}x its "
                          f"tolerance) but no single row could be confirmed{why}; {at}, "
                          f"{found.evaluations} forward evaluations", found.evaluations)
        power = fails_without(loss_along, own, input_path, seed=seed, rows=rows,
                              max_evaluations=budget, e_scale=e_scale, unit=unit,
                              grad_rtol=grad_rtol)
        kinked = (f"; {found.kinked} disagreeing direction(s) left out: the loss is not "
                  "smooth along them within the step (a kink, such as a router switching "
                  "experts), and no row confirmed them") if found.kinked else ""
        return passed(check, invariant, f"{found.evaluations} forward evaluations, {at}"
                      + ("; it fails the gradient without its input path" if power else "")
                      + kinked, found.evaluations, power)
    label, why = forward_pattern(list(found.wrong_rows), reads, tie.vocab,
                                 padding_idx=tie.padding_idx,
                                 input_reached=input_reached)
    return failed(check, invariant, label,
                  f"rows {list(found.wrong_rows)[:16]} disagree with the forward{why} "
                  f"({found.evaluations} forward evaluations, {at})", found.evaluations)


def tokens_of(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.reshape(-1).numpy(), dtype=np.int64)


def fd_budget(V: int) -> int:
    """Forward evaluations one localisation may spend: k wrong rows cost ~12 k log2 V, so this
    localises about five rows at any V and stops, with what it found, beyond that (a bug on
    every row needs no more rows to be named)."""
    return int(200 + 60 * np.log2(max(V, 2)))


def _close(a: np.ndarray, e: np.ndarray, count: int, unit: float = _U64) -> bool:
    """Agreement of two gradients summed over ``count`` terms in different orders, at the
    unit roundoff they were computed in: atol from the largest entry, rtol from the entry
    itself, both ~ count * unit."""
    scale = float(np.abs(e).max(initial=0.0))
    rtol = 8 * unit * count
    return bool(np.all(np.abs(a - e) <= rtol * scale + rtol * np.abs(e) + 1e-300))


def _count(t: torch.Tensor, tie: Tie) -> int:
    return int(t.numel()) * tie.width + tie.vocab


def _fresh(build: Build, tie: Tie, loss_of: Loss, t: torch.Tensor, y: torch.Tensor,
           unit: float) -> Finding:
    check = "fresh gradient"
    invariant = "two backward passes, each after zero_grad(), give the same gradient"
    m = build.fresh()
    grads = []
    for _ in range(2):
        m.zero_grad()
        _backward(m, loss_of, t, y)
        grads.append(_grad(m, tie))
    count = _count(t, tie)
    if _close(grads[1], grads[0], count, unit):
        return passed(check, invariant)
    if _close(grads[1] - grads[0], grads[0], count, unit):
        return failed(check, invariant, "gradient_not_zeroed",
                      "the second pass returned the first pass's gradient plus its own: a "
                      "buffer behind the tied gradient survives zero_grad()")
    return failed(check, invariant, "unknown", "the two passes differ (not by the first pass): "
                  "the backward is not deterministic in train() mode with dropout off")


_MICRO = ("k micro-batches, each backward of loss / k, sum to the gradient of one batch "
          "holding them all (one sequence: two calls sum to the sum of their gradients)")


#: Added to the check's seed for the pass that asks whether the gradient depends on torch's
#: generator (see :func:`_micro_batches`).
_OTHER_SEED = 7919


def _micro_batches(build: Build, tie: Tie, loss_of: Loss, t: torch.Tensor,
                   y: torch.Tensor, own: np.ndarray, unit: float, reseeded: Loss) -> Finding:
    check = "micro-batches accumulate"
    invariant = _MICRO
    k = int(t.shape[0])
    count = _count(t, tie)
    if k < 2:
        # one sequence per batch: two calls on two batches, accumulated, against the sum of
        # each one's own gradient (a `.grad =` keeps the last call's alone)
        t2, y2 = t.flip(-1), y.flip(-1)
        parts = []
        for tt, yy in ((t, y), (t2, y2)):
            one = build.fresh()
            _backward(one, loss_of, tt, yy, 0.5)
            parts.append(_grad(one, tie))
        m = build.fresh()
        _backward(m, loss_of, t, y, 0.5)
        _backward(m, loss_of, t2, y2, 0.5)
        total, expected, last = _grad(m, tie), parts[0] + parts[1], parts[1]
    else:
        m = build.fresh()
        for i in range(k):
            _backward(m, loss_of, t[i:i + 1], y[i:i + 1], 1.0 / k)
        total, expected = _grad(m, tie), own
        one = build.fresh()
        _backward(one, loss_of, t[k - 1:], y[k - 1:], 1.0 / k)
        last = _grad(one, tie)
    if _close(total, expected, count, unit):
        return passed(check, invariant, f"k = {max(k, 2)}")
    if _close(total, last, count, unit):
        return failed(check, invariant, "gradient_assigned",
                      f"after {max(k, 2)} micro-batches the tied gradient is the last one's "
                      "alone: the gradient is assigned (`.grad =`), not added, so earlier "
                      "micro-batches are lost")
    # A forward that draws random numbers in train() mode with dropout off (PhiMoE's
    # sparsemixer samples its experts) draws other numbers for a micro-batch than for the
    # whole batch, so the sum rightly differs.  Said so only where the whole batch's own
    # gradient changes with the generator's seed: a bug is not excused by a draw that
    # changes nothing.
    other = build.fresh()
    _backward(other, reseeded, t, y, 1.0)
    if not _close(_grad(other, tie), own, count, unit):
        return not_applicable(
            check, invariant, "the model's gradient changes with torch's generator in "
            "train() mode with dropout off (its forward samples, as a router may), so "
            f"{max(k, 2)} micro-batches draw other numbers than one batch and their "
            "gradients rightly differ")
    return failed(check, invariant, "unknown",
                  f"{max(k, 2)} micro-batches do not sum to the whole batch's gradient")


#: Optimizer steps a training loop takes before the gradient it then computes is judged: a
#: lookup that switches kernels after a few forwards, or state kept across steps, shows there.
TRAINING_STEPS = 3


def _training_steps(build: Build, target: TorchTarget, tie: Tie, loss_of: Loss,
                    t: torch.Tensor, y: torch.Tensor, seed: int,
                    input_reached: bool = True) -> Finding:
    """A training loop's gradient after ``TRAINING_STEPS`` optimizer steps, judged row by row
    against the reference built from that step's own uses, with the same engine.
    ``input_reached``: the first call's untied pass saw the lookup's gradient reach E (the
    same model code; a step's own pass says so too where its uses were all seen)."""
    from tyingspec._src.core.cases import kernel_paths
    from tyingspec._src.core.diagnosis import diagnose
    from tyingspec._src.kinds.torch.uses import observed_uses

    check = "gradient after training steps"
    invariant = (f"after {TRAINING_STEPS} optimizer steps, the tied gradient is still the "
                 "sum of both paths, row by row")
    m = build.fresh()
    try:
        opt = target.optimizer(m) if target.optimizer is not None else \
            torch.optim.SGD(m.parameters(), lr=1e-2)
    except Exception as exc:
        raise AdapterError(build.spec, "the target's optimizer raised", key="optimizer",
                           got=f"{type(exc).__name__}: {exc}") from exc
    for _ in range(TRAINING_STEPS):
        opt.zero_grad()
        _backward(m, loss_of, t, y)
        try:
            opt.step()
        except Exception as exc:
            raise AdapterError(build.spec, "the optimizer's step raised", key="optimizer",
                               got=f"{type(exc).__name__}: {exc}") from exc
    opt.zero_grad()
    E = m.get_parameter(tie.embedding)
    with observed_uses(E) as uses:
        loss = loss_of(m, t, y)
    loss.backward()  # type: ignore[no-untyped-call]
    steps = f"after {TRAINING_STEPS} steps of {type(opt).__name__}"
    problem = uses.problem()
    if problem is not None:
        # the uses this step takes cannot be vouched for (a lookup that switched to a custom
        # kernel): this step's gradient against the stepped model's own forward instead
        why = _differenced(m, _unit(uses.least_precise), build.dtype, tie, loss_of, t, y,
                           _grad(m, tie), seed, input_reached and uses.input_reached(),
                           _reads(m, {}, t, y), None, check, invariant)
        where = f"{steps}, against the forward (the uses cannot be observed: {problem})"
        return replace(why, detail=f"{where}: {why.detail}")
    paths = kernel_paths(*_observed(uses, tie), tie.vocab, "float64")
    diag = diagnose(_grad(m, tie), paths, dtype=build.precision)
    if not diag.wrong:
        return passed(check, invariant, steps)
    return failed(check, invariant, diag.label,
                  f"{steps}: rows {diag.wrong_rows[:16]} wrong ({diag.detail})")
