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

from tyingspec._src.core.adapters import AdapterError, Returned
from tyingspec._src.core.cases import kernel_paths
from tyingspec._src.core.diagnosis import diagnose
from tyingspec._src.core.findings import Finding, failed, not_applicable, passed, uses_unobserved
from tyingspec._src.core.forward_check import AGAINST as _AGAINST
from tyingspec._src.core.forward_check import judge_against_forward
from tyingspec._src.core.process_state import torch_state_kept
from tyingspec._src.core.tolerance import UNIT_ROUNDOFF, Precision, precision_of, unit_of
from tyingspec._src.kinds.torch.batch import TorchBatch, make_batch, model_device
from tyingspec._src.kinds.torch.budget import fitted
from tyingspec._src.kinds.torch.discover import (
    Loss,
    Tie,
    as_target,
    build_model,
    declared_ints,
    describe,
    forward,
    loss_function,
    model_sources,
    owner,
)
from tyingspec._src.kinds.torch.identity import identity_findings, optimizer_findings
from tyingspec._src.kinds.torch.setting import Setting, parse
from tyingspec._src.kinds.torch.step import (
    CHECK,
    Loop,
    invariant,
    lower,
    observed_arrays,
    one_copy,
    path_factors,
    run_loop,
)
from tyingspec._src.kinds.torch.tables import (
    frozen_table,
    renormalised_rows,
    renormalising,
    tied_grad,
)
from tyingspec._src.kinds.torch.target import TorchTarget
from tyingspec._src.kinds.torch.uses import TorchUnsupported, observed_uses

if TYPE_CHECKING:
    from tyingspec._src.kinds.torch.uses import Uses

#: The checks one call can run; a property asks for its own, ``tyingspec check`` for all.
CHECKS = ("identity", "optimizer", "gradient", "forward", "fresh", "micro_batches", "steps")

#: Identity and optimizer findings per target, run once per worker: they do not depend on the
#: batch (each rebuilds the model from its factory), and they are the slow part of a call.
_STRUCTURAL: dict[tuple[str, str], list[Finding]] = {}

_U64 = UNIT_ROUNDOFF["float64"]


def _numpy(t: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
    if t is None:
        return np.zeros(shape)
    # the rows of the vocabulary the check runs: a use that holds more (a lost tie whose
    # uses have two vocabularies) has its own rows beyond it
    return np.asarray(t.detach()[:shape[0]].to(torch.float64).cpu().numpy(),
                      dtype=np.float64).copy()


def call_torch(spec: str, fn: Any, inputs: Mapping[str, Any]) -> Returned:
    """Describe the model (``inputs["mode"] == "describe"``) or observe it on a batch; the
    process's torch state is as it was afterwards (see :mod:`core.process_state`)."""
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
    setting = _setting(spec, inputs, target)
    build = Build(spec, target, seed, str(inputs.get("precision", "auto")), setting)
    model = build.fresh()
    tie, found = describe(spec, model, target)
    if inputs.get("mode") == "describe":
        tie, note = fitted(build, tie)
        return Returned(np.zeros((0, 0)), (), build.precision,
                        evidence={"tie": asdict(tie), "shape_note": note,
                                  "sequences_fixed": bool(target.batch_size)},
                        findings=(found,))
    tokens = np.asarray(inputs["tokens"], dtype=np.int64).reshape(-1)
    sequences = setting.B or tie.batch_size
    batch = make_batch(spec, tokens, np.asarray(inputs["targets"], dtype=np.int64).reshape(-1),
                       setting, vocab=tie.vocab, sequences=sequences, pad_token=tie.pad_token,
                       padding_idx=None if _pad_named_real(model, tie) else tie.padding_idx,
                       ignore_index=tie.ignore_index, takes_mask=tie.takes_mask, seed=seed)
    path = tie.paths[setting.loss % len(tie.paths)] if tie.paths else tie.convention
    raw_loss = loss_function(target, tie, path)
    loss_of = _scalar(spec, raw_loss, seed, target.after_backward, setting.autocast)
    checks = tuple(inputs.get("checks", CHECKS))
    findings: list[Finding] = [found, _configuration(tie, setting, batch, path, build)]
    if found.failed:  # no tie: nothing to keep identical, and two tensors for the optimizer
        checks = tuple(c for c in checks if c not in ("identity", "optimizer"))
    for group in ("identity", "optimizer"):
        if group in checks:
            findings += _structural(spec, target, seed, tie, group, loss_of, batch,
                                    _DTYPES.get(build.asked or ""))
    try:
        evidence, own, loss = _observe_paths(build, model, tie, loss_of, batch)
    except AdapterError as exc:
        if not found.failed or exc.key != "forward":
            raise
        return _untied_forward_raised(build, tie, findings, exc)
    unit = unit_of(build.computed)
    scaled = evidence.pop("path_factors", None)
    if scaled:
        findings.append(failed("paths enter once", "each path enters the tied gradient with "
                               "factor 1", "path_scaled",
                               f"{scaled}, fitted over every entry of the tied gradient (each "
                               "row is within its rounding bound alone)"))
    kept = evidence.pop("one_copy", None)
    if kept:
        findings.append(failed("repeated tokens accumulate", "a token read k times gets all k "
                               "of its input-path contributions", "duplicates_not_accumulated",
                               f"the tied gradient is exactly the reference with {kept}"))
    if evidence["observed_by"] != "uses":
        findings.append(uses_unobserved(
            f"a use of the tied weight cannot be observed ({evidence['why']}), so dx, h and g "
            "cannot be vouched for; the tied gradient is checked against the forward instead"))
    if tie.padding_idx is not None:
        # what the lookups read, less a pad token the batch only ever pads with
        reads = set(_reads(model, evidence, batch).tolist())
        if tie.padding_idx not in batch.real_tokens():
            reads.discard(tie.padding_idx)
        findings.append(_padding_row(model, tie, frozenset(reads)))
    if path in ("labels", "targets") and tie.convention != "custom":
        findings.append(_own_loss(build, tie, path, batch))
    if "forward" in checks:
        findings.append(_against_forward(build, tie, loss_of, batch, own, seed,
                                         bool(evidence.get("input_reached", True)),
                                         _reads(model, evidence, batch),
                                         _power_probe(build, evidence, tie),
                                         output_reached=bool(evidence.get("output_reached",
                                                                          True))))
    if "fresh" in checks:
        findings.append(_fresh(build, tie, loss_of, batch, unit))
    if "micro_batches" in checks:
        # the same loss under another generator seed: a forward that draws random numbers
        # (a router's sampling) is told from a micro-batch bug by it
        reseeded = _scalar(spec, raw_loss, seed + _OTHER_SEED, target.after_backward,
                           setting.autocast)
        renormalises = renormalising(model, tie.embedding)
        findings.append(_micro_batches(build, tie, loss_of, batch, unit, reseeded,
                                       setting, evidence["observed_by"] == "uses") if not
                        tie.scale_grad_by_freq and renormalises is None else not_applicable(
                            "micro-batches accumulate", _MICRO, renormalises or
                            "nn.Embedding(scale_grad_by_freq=True) divides by each token's "
                            "count within a call, so micro-batches rightly differ from one "
                            "batch"))
    if "steps" in checks:
        findings.append(_training_steps(build, target, tie, loss_of, batch, setting, seed,
                                        bool(evidence.get("input_reached", True))))
    evidence["tie"] = asdict(tie)
    return Returned(own, (), build.precision, loss=loss, evidence=evidence,
                    findings=tuple(findings))


def _setting(spec: str, inputs: Mapping[str, Any], target: TorchTarget) -> Setting:
    """The case's setting (see :mod:`kinds.torch.setting`), with the target's own autocast
    and compile, which the command line's flags cannot take away."""
    try:
        setting = parse(str(inputs.get("setting", "")))
    except ValueError as exc:
        raise AdapterError(spec, "a bad torch setting", key="setting", got=str(exc)) from None
    if target.autocast:
        setting = replace(setting, autocast=str(target.autocast))
    if target.compile:
        setting = replace(setting, compile="inductor" if target.compile is True
                          else str(target.compile))
    if setting.compile:
        # compiled code draws its own random numbers (philox), so an eager twin's dropout
        # masks are not its masks: compiled checks run without dropout
        setting = replace(setting, dropout=False)
    if target.device:
        if setting.device and setting.device != target.device:
            raise AdapterError(spec, "two devices asked for", key="device",
                               expected=f"--device {setting.device}",
                               got=f"TorchTarget(device={target.device!r})")
        setting = replace(setting, device=str(target.device))
    if setting.device:
        _usable(spec, setting.device)
    return setting


def _usable(spec: str, device: str) -> None:
    """An adapter error unless torch can place a tensor on ``device`` (naming the device and
    torch's version, as ``--kind linear-ce`` does): never a silent run on the CPU."""
    if device.partition(":")[0] == "cuda" and not torch.cuda.is_available():
        raise AdapterError(spec, f"--device {device}: torch sees no CUDA device here",
                           key="device", expected="torch.cuda.is_available()",
                           got=f"False (torch {torch.__version__})")
    if device.partition(":")[0] == "meta":  # shapes without values: no gradient to judge
        raise AdapterError(spec, f"--device {device}: the meta device holds no values",
                           key="device", expected="a device that computes (cpu, cuda, ...)",
                           got=device)
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001  (a device name torch refuses, or one it lacks)
        raise AdapterError(spec, f"--device {device}: torch cannot place a tensor there",
                           key="device", expected=f"a device torch {torch.__version__} has",
                           got=f"{type(exc).__name__}: {exc}") from None


def _configuration(tie: Tie, setting: Setting, batch: TorchBatch, path: str,
                   build: Build) -> Finding:
    """What this case trains: a line of the report, so a verdict says what it covered."""
    words = {"labels": "the model's labels= loss", "targets": "the model's own targets loss",
             "logits": "its logits with mean cross-entropy", "custom": "the target's loss"}
    parts = [batch.describe(), f"loss: {words.get(path, path)}"]
    if len(tie.paths) > 1:
        parts[-1] += f" (paths: {', '.join(tie.paths)})"
    dropout = build.dropout_rates()
    parts.append(f"dropout {'kept at ' + dropout if setting.dropout and dropout else 'off'}")
    if build.target.step is not None:
        parts.append(f"{setting.steps} steps of your step ({setting.micro} micro-batches in "
                     "the check's own passes)")
    else:
        parts.append(f"{setting.micro} micro-batches, {setting.steps} optimizer steps")
    if setting.autocast:
        parts.append(f"autocast {setting.autocast}")
    if setting.compile:
        parts.append(f"torch.compile ({setting.compile})")
    if setting.device:
        parts.append(f"on {setting.device}, judged on the CPU")
    return passed("configuration", "the case trains as the model trains: its context, "
                  "padding, masks, loss path, dropout, accumulation and steps", "; ".join(parts))


def _pad_named_real(model: nn.Module, tie: Tie) -> bool:
    """The padding row is a real token by the model's own word: a config that names another
    pad token (then a batch rightly reads row p as a token, and the padding-row finding
    applies)."""
    if tie.padding_idx is None:
        return False
    declared = _declared_padding(model, tie.vocab)
    return bool(declared) and tie.padding_idx not in declared


def _untied_forward_raised(build: Build, tie: Tie, findings: list[Finding],
                           exc: AdapterError) -> Returned:
    """The call's result when discovery found the tie already broken and the model's forward
    then raises: the break is the verdict (a resize that left the head with the old
    vocabulary while the config names the new one makes the model's own loss reshape fail
    on every batch), not an adapter error.  No row is compared: there is no one tied
    gradient to compare."""
    shape = (tie.vocab, tie.width)
    findings = [*findings, uses_unobserved(
        f"the model's forward raised ({exc.got}), which the broken tie explains: no gradient "
        "is read")]
    evidence = {"observed_by": "none", "dE_in": np.zeros(shape), "dE_out": np.zeros(shape),
                "input_reached": True, "output_reached": True, "tie": asdict(tie),
                "why": f"the model's forward raised: {exc.got}"}
    return Returned(np.zeros(shape), (), build.precision, loss=0.0, evidence=evidence,
                    findings=tuple(findings))


class Build:
    """Fresh models from the target's factory, as the user trains them: in the model's own
    dtype (or the one asked for, where the model converts), in ``train()`` mode, with its
    configured dropout kept where the case keeps it (every pass reseeds torch's generator,
    so two passes of one check draw the same masks) and set to 0 otherwise (the
    ``nn.Dropout`` modules and the ``*dropout*``/``*pdrop*`` floats transformers' attention
    reads).  Each model is built anew, never deep-copied: a deep copy keeps closures over the
    original module (minGPT's ``Block.mlpf`` lambda), and the checks must see the user's own
    model."""

    def __init__(self, spec: str, target: TorchTarget, seed: int, precision: str,
                 setting: Setting | None = None) -> None:
        self.spec, self.target, self.seed = spec, target, seed
        self.setting = setting or Setting()
        self.asked = precision if precision in _DTYPES else None
        self.dtype: torch.dtype | None = None  # the dtype the model trains in, once known
        self._rates: dict[str, float] = {}

    @property
    def computed(self) -> torch.dtype:
        """The dtype the gradient is computed in: the model's, or autocast's where lower."""
        dtype = self.dtype or torch.float64
        if self.setting.autocast:
            low: torch.dtype = getattr(torch, self.setting.autocast)
            dtype = low if low.itemsize < dtype.itemsize else dtype
        return dtype

    @property
    def precision(self) -> Precision:
        return precision_of(str(self.computed).removeprefix("torch."))

    def fresh(self, dtype: torch.dtype | None = None, *, dropout: bool | None = None
              ) -> nn.Module:
        model = build_model(self.spec, self.target, self.seed)
        want = dtype or (_DTYPES[self.asked] if self.asked else None)
        if want is not None:
            try:
                model = model.to(want)
            except Exception:  # noqa: BLE001  (a model that cannot convert keeps its own)
                if dtype is not None:
                    raise
        if self.setting.device:
            model = model.to(self.setting.device)  # after any dtype conversion, as users do
        if self.dtype is None:
            self.dtype = _float_dtype(model)
        keep = self.setting.dropout if dropout is None else dropout
        rates = _train(model, keep)
        if not self._rates:
            self._rates = rates
        return model

    def dropout_rates(self) -> str:
        """The model's configured dropout rates, as a report says them ("" when none)."""
        rates = sorted({r for r in self._rates.values() if r > 0})
        return ", ".join(f"{r:g}" for r in rates)


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of the model's parameters hold (what it trains in)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda k: counts[k]) if counts else torch.float32


def _train(model: nn.Module, keep_dropout: bool) -> dict[str, float]:
    """``train()`` mode, dropout kept or set to 0; the configured rates, by where they are."""
    model.train()
    rates: dict[str, float] = {}
    for mname, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            rates[mname] = float(module.p)
            if not keep_dropout:
                module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and _is_dropout(name):
                rates[f"{mname}.{name}"] = value
                if not keep_dropout:
                    setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and value and _is_dropout(name):
                rates[f"config.{name}"] = value
                if keep_dropout:
                    continue
                try:
                    setattr(config, name, 0.0)
                except Exception:  # noqa: BLE001  (a frozen config: its modules were zeroed)
                    pass
    return rates


def _is_dropout(name: str) -> bool:
    low = name.lower()
    return "dropout" in low or "pdrop" in low or low.endswith("_drop") or "drop_path" in low


def _structural(spec: str, target: TorchTarget, seed: int, tie: Tie, group: str,
                loss_of: Loss, batch: TorchBatch,
                dtype: torch.dtype | None = None) -> list[Finding]:
    """The identity or the optimizer findings of a target, computed once per worker, on
    models at the run's precision (``dtype``: the one asked for, else each model's own)."""
    key = (spec, f"{group} at {dtype}")
    if key not in _STRUCTURAL:
        def factory() -> nn.Module:
            return build_model(spec, target, seed)

        def loss_at(m: nn.Module) -> torch.Tensor:
            return loss_of(m, batch)

        _STRUCTURAL[key] = identity_findings(
            factory, tie.embedding, tie.head, retie=target.retie, loss_of=loss_at,
            dtype=dtype) if group == "identity" else optimizer_findings(
                factory, tie.embedding, tie.head, optimizer=target.optimizer, loss_of=loss_at,
                spec=spec, dtype=dtype)
    return _STRUCTURAL[key]


def _scalar(spec: str, loss_of: Loss, seed: int,
            after_backward: Callable[[nn.Module], None] | None, autocast: str = "") -> Loss:
    """``loss_of`` that reseeds torch's generator before every pass (so every pass of one
    check draws the same dropout masks), runs the forward under the case's autocast, names
    the target when the model's loss is not a finite scalar tensor (every check, identity and
    optimizer included, takes its loss through it), and runs the target's ``after_backward``
    once the loss's backward has run."""
    low = getattr(torch, autocast) if autocast else None

    def checked(m: nn.Module, b: TorchBatch) -> torch.Tensor:
        torch.manual_seed(seed + 1)
        try:
            if low is not None:
                with torch.autocast(model_device(m).type, dtype=low):
                    loss = loss_of(m, b)
            else:
                loss = loss_of(m, b)
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(spec, "the model's forward raised", key="forward",
                               got=f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise AdapterError(spec, "the loss is not a scalar tensor",
                               expected="a 0-dim tensor", got=repr(loss)[:80])
        if after_backward is not None and loss.requires_grad:
            loss.register_hook(  # type: ignore[no-untyped-call]
                lambda g: _after(m, after_backward))
        return loss
    return checked


def _after(model: nn.Module, after_backward: Callable[[nn.Module], None]) -> None:
    # a hook on the loss fires first in its backward; what must run after the whole backward
    # is queued on the autograd engine's final callbacks
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(lambda: after_backward(model))


def _backward(m: nn.Module, loss_of: Loss, b: TorchBatch, scale: float = 1.0) -> torch.Tensor:
    loss = loss_of(m, b)
    (loss * scale).backward()  # type: ignore[no-untyped-call]
    return loss


def _grad(m: nn.Module, tie: Tie) -> np.ndarray:
    # a parametrized table's gradient is dL/dW, where its uses read it (see kinds.torch.tables)
    return _numpy(tied_grad(m, tie.embedding), (tie.vocab, tie.width))


def _observe_paths(build: Build, m: nn.Module, tie: Tie, loss_of: Loss, b: TorchBatch
                   ) -> tuple[dict[str, Any], np.ndarray, float]:
    """The model's own tied gradient, and dx, h, g recorded at every use of the tied
    Parameter (see :mod:`kinds.torch.uses`)."""
    E = m.get_parameter(tie.embedding)
    m.zero_grad(set_to_none=True)
    with observed_uses(E) as uses:
        loss_t = loss_of(m, b)
    loss_t.backward()  # type: ignore[no-untyped-call]
    loss = float(loss_t.detach())
    own = _grad(m, tie)
    if build.setting.compile:
        # the gradient judged is the compiled model's; the eager pass above, on a model built
        # from the same seed, is where its uses are observed
        compiled = build.fresh()
        compiled.compile(backend=build.setting.compile, dynamic=True)
        compiled.zero_grad(set_to_none=True)
        try:
            loss_of(compiled, b).backward()  # type: ignore[no-untyped-call]
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(build.spec, "the compiled model raised", key="compile",
                               got=f"{type(exc).__name__}: {exc}") from exc
        own = _grad(compiled, tie)
    why = uses.problem()
    evidence: dict[str, Any] = {"least_precise": str(uses.least_precise).removeprefix("torch.")}
    if why is None:
        ids, dx, h, g = observed_arrays(uses, tie)
        evidence.update(observed_by="uses", tokens=ids, dx=dx, h=h, g=g,
                        lookups=len(uses.lookups), heads=len(uses.heads))
        at = lower(build.precision, uses.least_precise)
        if not diagnose(own, kernel_paths(ids, dx, h, g, tie.vocab, "float64"),
                        dtype=at).wrong:
            # right row by row: at a low precision a stray factor on a path can hide in the
            # rows' bounds (see step.path_factors)
            evidence["path_factors"] = path_factors(own, ids, dx, h, g, tie.vocab, at)
        elif len(np.unique(ids)) < len(ids):
            # wrong: is it exactly one copy of each repeated token (see step.one_copy)?
            evidence["one_copy"] = one_copy(own, uses, tie, at)
        skipped = [u["pad_input"][1] for u in uses.lookups
                   if u.get("pad_input") is not None and u["pad_input"][0] == tie.padding_idx]
        if skipped:
            evidence["pad_input"] = np.sum(skipped, axis=0)
    else:
        evidence.update(_untied_split(build, tie, loss_of, b), why=why)
    return evidence, own, loss


_MEAN_CE = ("the model's own loss is the mean token cross-entropy of its own logits (causal "
            "or unshifted targets)")


def _loss_and_logits(m: nn.Module, tie: Tie, path: str, b: TorchBatch,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The loss and the logits one call of the model's loss path ``path`` returns."""
    out = forward(m, tie, path, b)
    parts = list(out) if isinstance(out, (tuple, list)) else [
        getattr(out, "loss", None), getattr(out, "logits", None)]
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    loss = next((p for p in tensors if p.dim() == 0), None)
    logits = next((p for p in tensors if p.dim() >= 2 and p.shape[-1] == tie.vocab), None)
    return loss, logits


def _own_loss(build: Build, tie: Tie, path: str, b: TorchBatch) -> Finding:
    """The loss a model trains with is part of what is judged: a sum over tokens divided by
    the number of sequences (the class of transformers' 2024 gradient-accumulation bug), or by
    every position with the ignored ones counted, scales the gradient with it, and no row can
    show that, because both paths scale alike."""
    check = "loss is the mean token cross-entropy"
    m = build.fresh()
    torch.manual_seed(build.seed + 1)
    with torch.no_grad():
        try:
            loss, logits = _loss_and_logits(m, tie, path, b)
        except Exception as exc:  # noqa: BLE001  (the forward's own errors show elsewhere)
            return not_applicable(check, _MEAN_CE, f"the forward raised {exc!r}"[:200])
    y = b.targets.to(logits.device) if logits is not None else b.targets
    if loss is None or logits is None or logits.shape[:-1] != y.shape:
        return not_applicable(check, _MEAN_CE, "the model returns no logits beside its loss")
    z = logits.detach().double()
    V = z.shape[-1]
    ignore = b.ignore_index
    shifted = (z[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))
    flat = (z.reshape(-1, V), y.reshape(-1))
    candidates = {"unshifted": flat, "causal": shifted}
    means = {name: F.cross_entropy(zz, yy, ignore_index=ignore)
             for name, (zz, yy) in candidates.items()}
    got = float(loss)
    u = unit_of(loss.dtype if loss.is_floating_point() else None)
    atol = 64 * u * (1.0 + float(z.abs().max()))
    if any(abs(got - float(c)) <= atol + 64 * u * abs(float(c)) for c in means.values()):
        return passed(check, _MEAN_CE)
    B, T = (int(n) for n in y.shape)
    counts = {T: f"T = {T}", T - 1: f"T - 1 = {T - 1}", B: f"B = {B}", B * T: "B x T",
              1 / B: "1 / B", 1 / T: "1 / T"}
    for name, c in means.items():
        ratio = got / float(c) if float(c) else float("nan")
        zz, yy = candidates[name]
        kept = int((yy != ignore).sum())
        if kept and kept < yy.numel() and abs(ratio - kept / yy.numel()) <= 1e-3 * ratio:
            return failed(check, _MEAN_CE, "ignored_counted_in_mean",
                          f"the loss is {ratio:.6g} x the mean {name} token cross-entropy "
                          f"= {kept} counted targets / {yy.numel()} positions: it divides by "
                          f"every position, the {yy.numel() - kept} ignored ({ignore}) ones "
                          "included, and the gradient is scaled with it")
        for value, what in counts.items():
            if value != 1 and abs(ratio - value) <= 1e-3 * value:
                return failed(check, _MEAN_CE, "loss_misnormalised",
                              f"the loss is {ratio:.6g} x the mean {name} token cross-entropy "
                              f"of the model's own logits ({what}, for a batch of B = {B} "
                              f"sequences of T = {T}): a sum over tokens divided by the number "
                              "of sequences, not of tokens, and the gradient is scaled with it")
    causal, unshifted = float(means["causal"]), float(means["unshifted"])
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


def _reads(model: nn.Module, evidence: dict[str, Any], b: TorchBatch) -> np.ndarray:
    """The ids the lookups read, with their multiplicity: observed, or, where the uses could
    not be observed, the tokens and, for an encoder-decoder, the decoder's inputs (the labels
    shifted right behind its start token, as transformers builds them)."""
    if evidence.get("observed_by") == "uses":
        return np.asarray(evidence["tokens"], dtype=np.int64)
    config = getattr(model, "config", None)
    start = getattr(config, "decoder_start_token_id", None)
    t, y = b.tokens, b.targets
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(start, int):
        return tokens_of(t)
    pad = getattr(config, "pad_token_id", None)
    shifted = y[:, :-1].numpy().astype(np.int64)
    if isinstance(pad, int):
        shifted = np.where(shifted == b.ignore_index, pad, shifted)
    decoder = np.concatenate([np.full((y.shape[0], 1), start, dtype=np.int64), shifted],
                             axis=1)
    return np.concatenate([tokens_of(t), decoder.reshape(-1)])


def _untied_split(build: Build, tie: Tie, loss_of: Loss, b: TorchBatch) -> dict[str, Any]:
    """Each use's gradient from the model's own backward, the uses handed separate copies
    (see :func:`_split_loss`)."""
    loss, E_in, E_out = _split_loss(build.fresh(), tie, loss_of, b)
    d_in, d_out = torch.autograd.grad(loss, (E_in, E_out), allow_unused=True)
    shape = (tie.vocab, tie.width)
    # d_in None: the lookup never reaches E through autograd (a detached read, or a custom
    # Function that writes .grad itself); the same for d_out
    return {"observed_by": "functional_call", "dE_in": _numpy(d_in, shape),
            "dE_out": _numpy(d_out, shape), "input_reached": d_in is not None,
            "output_reached": d_out is not None}


def _input_reaches(m: nn.Module, tie: Tie, loss_of: Loss, b: TorchBatch) -> bool:
    """Whether the lookup's gradient reaches the tied weight through autograd in ``m`` as it
    is now (a model that switched to a detached read after a few steps no longer does)."""
    loss, E_in, _ = _split_loss(m, tie, loss_of, b)
    (d_in,) = torch.autograd.grad(loss, (E_in,), allow_unused=True)
    return d_in is not None


def _split_loss(base: nn.Module, tie: Tie, loss_of: Loss, b: TorchBatch
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``loss_of(base, b)`` with the uses handed separate copies of the tied weight: every
    name of the tied Parameter whose module reads rows gets ``E_in``, every other name
    ``E_out``.  The user's loss is handed the user's own model (its attributes are the ones a
    loss or a gradient hook reads), its parameters swapped by ``functional_call`` for the
    length of the call."""
    from torch.func import functional_call

    E = base.get_parameter(tie.embedding).detach()
    names = [n for n, p in base.named_parameters(remove_duplicate=False)
             if p is base.get_parameter(tie.embedding)]
    E_in = E.clone().requires_grad_(True)
    E_out = E.clone().requires_grad_(True)
    given = {n: E_in if isinstance(owner(base, n), nn.Embedding) or n == tie.embedding else
             E_out for n in names}
    if tie.head not in names:  # two Parameters (a copy): the head's own name
        given[tie.head] = E_out

    def whole(*_: Any) -> torch.Tensor:
        # functional_call calls the module; its forward, for this one call, is the user's
        # whole loss on the user's own model (the class's forward is back inside it)
        del base.forward
        return loss_of(base, b)

    base.forward = whole
    try:
        loss = functional_call(base, given, (), tie_weights=False)
    finally:
        base.__dict__.pop("forward", None)
    return loss, E_in, E_out


def _power_probe(build: Build, evidence: dict[str, Any], tie: Tie) -> np.ndarray | None:
    """The input path, for the forward check to show it could tell it missing, where the
    rows may not: a low-precision model (its rounding bound can exceed a row), or uses that
    could not be observed (the rows then are the model's own)."""
    low = build.computed in (torch.bfloat16, torch.float16)
    if evidence.get("observed_by") == "uses":
        if not low:
            return None
        dE_in = np.zeros((tie.vocab, tie.width))
        np.add.at(dE_in, evidence["tokens"], evidence["dx"])
        return dE_in
    return np.asarray(evidence["dE_in"], dtype=np.float64)


def _forward_model(build: Build, tie: Tie, loss_of: Loss, b: TorchBatch
                   ) -> tuple[nn.Module, torch.dtype]:
    """The model the forward check differences, and the dtype its loss is really computed
    in: a float64 build where the model converts and runs in float64 (central
    differences are far sharper there), else the model in the dtype it trains in."""
    for dtype in (torch.float64, None):
        try:
            m = build.fresh(dtype)
            E = m.get_parameter(tie.embedding)
            with torch.no_grad(), observed_uses(E) as uses:
                value = loss_of(m, b)
            if dtype is not None and not bool(torch.isfinite(value)):
                continue
            return m, uses.least_precise
        except Exception:  # noqa: BLE001  (no float64 kernel: the model's own dtype)
            if dtype is None:
                raise
    raise AssertionError("unreachable")


def _against_forward(build: Build, tie: Tie, loss_of: Loss, b: TorchBatch,
                     own: np.ndarray, seed: int,
                     input_reached: bool, reads: np.ndarray,
                     input_path: np.ndarray | None = None, *,
                     output_reached: bool = True) -> Finding:
    """``reads``: the ids the lookups read (see :func:`_reads`).  ``input_path``: when given,
    a passing check is also run on the gradient without it, and has power when that one
    fails."""
    m, loss_dtype = _forward_model(build, tie, loss_of, b)
    return _differenced(m, loss_dtype, build.computed, tie, loss_of, b, own, seed, input_reached,
                        reads, input_path, "gradient against the forward", _AGAINST,
                        output_reached=output_reached)


def _differenced(m: nn.Module, loss_dtype: torch.dtype | None, dtype: torch.dtype | None,
                 tie: Tie, loss_of: Loss,
                 b: TorchBatch, own: np.ndarray, seed: int,
                 input_reached: bool, reads: np.ndarray, input_path: np.ndarray | None,
                 check: str, invariant: str, *, output_reached: bool = True) -> Finding:
    """``own`` against directional differences of ``m``'s loss, computed in ``loss_dtype``
    (``dtype``: what ``own`` was computed in), judged by :mod:`core.forward_check`."""
    E = frozen_table(m, tie.embedding)  # a parametrized table: W, held fixed from here on
    e_scale = float(E.detach().double().std()) or 1.0

    def loss_along(rows: np.ndarray, D: np.ndarray, step: float) -> float:
        idx = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        with torch.no_grad():
            saved = E[idx].clone()
            E[idx] = (saved.double() + step * torch.from_numpy(
                np.asarray(D, dtype=np.float64)).to(E.device)).to(E.dtype)
            try:
                return float(loss_of(m, b))
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
    # and max_norm: a read row at the renormalisation is rescaled by the forward it is
    # differenced through, while its gradient treats the rescaling as a constant
    rows = np.setdiff1d(rows, renormalised_rows(m, tie.embedding, reads))
    return judge_against_forward(loss_along, own, check=check, invariant=invariant, seed=seed,
                                 reads=reads, vocab=tie.vocab, loss_precision=loss_dtype,
                                 grad_dtype=dtype, e_scale=e_scale, rows=rows,
                                 padding_idx=tie.padding_idx, input_reached=input_reached,
                                 output_reached=output_reached, input_path=input_path)


def tokens_of(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.reshape(-1).numpy(), dtype=np.int64)


def _close(a: np.ndarray, e: np.ndarray, count: int, unit: float = _U64) -> bool:
    """Agreement of two gradients summed over ``count`` terms in different orders, at the
    unit roundoff they were computed in: atol from the largest entry, rtol from the entry
    itself, both ~ count * unit."""
    scale = float(np.abs(e).max(initial=0.0))
    rtol = 8 * unit * count
    return bool(np.all(np.abs(a - e) <= rtol * scale + rtol * np.abs(e) + 1e-300))


def _count(b: TorchBatch, tie: Tie) -> int:
    return int(b.tokens.numel()) * tie.width + tie.vocab


def _fresh(build: Build, tie: Tie, loss_of: Loss, b: TorchBatch, unit: float) -> Finding:
    check = "fresh gradient"
    invariant = "two backward passes, each after zero_grad(), give the same gradient"
    m = build.fresh()
    grads = []
    for _ in range(2):
        m.zero_grad()
        _backward(m, loss_of, b)
        grads.append(_grad(m, tie))
    count = _count(b, tie)
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


def _micro_batches(build: Build, tie: Tie, loss_of: Loss, b: TorchBatch, unit: float,
                   reseeded: Loss, setting: Setting, observed: bool) -> Finding:
    """k micro-batches, each ``backward`` of ``loss / k``: where the uses are observed, the
    accumulated tied gradient against the sum of the uses every micro-batch took (padding and
    dropout weigh nothing there; a ``.grad =`` keeps the last one's alone); then, where no
    target is ignored (the parts weigh alike), the model's own accumulation against its own
    whole batch, dropout off."""
    check = "micro-batches accumulate"
    invariant = _MICRO
    micro = setting.micro
    if observed:
        # one sequence: it and its reverse, two micro-batches
        two = b if b.sequences > 1 else _stacked(b, b.flipped())
        k = max(2, min(micro, two.sequences))
        loop = Loop(build.spec, build.target, tie, loss_of, two, 1, k, build.seed,
                    build.precision, setting.autocast, setting.compile, check=check,
                    invariant=invariant, user_step=False)
        found = run_loop(loop, build.fresh)
        if found.outcome != "passed" or b.ignored():
            return replace(found, detail=f"k = {k}, against the uses they took" if
                           found.outcome == "passed" else
                           found.detail.replace("step 1 of 1: ", ""))
        # and, where the parts weigh alike, against the whole batch itself (a forward that
        # computes another function of a smaller batch breaks accumulation too)
    if b.ignored():
        return not_applicable(check, invariant, "the batch ignores some targets, so its parts "
                              "weigh differently; the accumulation is judged at every "
                              "training step instead")
    B = b.sequences
    k = micro if micro > 1 and B % micro == 0 else B
    count = _count(b, tie)
    whole = build.fresh(dropout=False)
    _backward(whole, loss_of, b)
    own = _grad(whole, tie)
    if B < 2:
        # one sequence per batch: two calls on two batches, accumulated, against the sum of
        # each one's own gradient (a `.grad =` keeps the last call's alone)
        b2 = b.flipped()
        parts = []
        for bb in (b, b2):
            one = build.fresh(dropout=False)
            _backward(one, loss_of, bb, 0.5)
            parts.append(_grad(one, tie))
        m = build.fresh(dropout=False)
        _backward(m, loss_of, b, 0.5)
        _backward(m, loss_of, b2, 0.5)
        total, expected, last = _grad(m, tie), parts[0] + parts[1], parts[1]
        k = 2
    else:
        pieces = b.split(k)
        m = build.fresh(dropout=False)
        for piece in pieces:
            _backward(m, loss_of, piece, 1.0 / len(pieces))
        total, expected = _grad(m, tie), own
        one = build.fresh(dropout=False)
        _backward(one, loss_of, pieces[-1], 1.0 / len(pieces))
        last = _grad(one, tie)
    if _close(total, expected, count, unit):
        return passed(check, invariant, f"k = {k}")
    if _close(total, last, count, unit):
        return failed(check, invariant, "gradient_assigned",
                      f"after {k} micro-batches the tied gradient is the last one's "
                      "alone: the gradient is assigned (`.grad =`), not added, so earlier "
                      "micro-batches are lost")
    # A forward that draws random numbers in train() mode with dropout off (PhiMoE's
    # sparsemixer samples its experts) draws other numbers for a micro-batch than for the
    # whole batch, so the sum rightly differs.  Said so only where the whole batch's own
    # gradient changes with the generator's seed: a bug is not excused by a draw that
    # changes nothing.
    other = build.fresh(dropout=False)
    _backward(other, reseeded, b, 1.0)
    if not _close(_grad(other, tie), own, count, unit):
        return not_applicable(
            check, invariant, "the model's gradient changes with torch's generator in "
            "train() mode with dropout off (its forward samples, as a router may), so "
            f"{k} micro-batches draw other numbers than one batch and their "
            "gradients rightly differ")
    return failed(check, invariant, "unknown",
                  f"{k} micro-batches do not sum to the whole batch's gradient")


def _stacked(a: TorchBatch, b: TorchBatch) -> TorchBatch:
    mask = None if a.mask is None or b.mask is None else torch.cat([a.mask, b.mask])
    return TorchBatch(torch.cat([a.tokens, b.tokens]), torch.cat([a.targets, b.targets]), mask,
                      a.ignore_index)


def _training_steps(build: Build, target: TorchTarget, tie: Tie, loss_of: Loss,
                    b: TorchBatch, setting: Setting, seed: int,
                    input_reached: bool = True) -> Finding:
    """The training loop, judged at each of the case's steps (see :mod:`kinds.torch.step`):
    the user's step or the check's own.  Where a step's uses cannot be observed (a lookup
    that switched to a custom kernel), that step's gradient is judged against the stepped
    model's own forward instead."""
    def objective(m: nn.Module, bb: TorchBatch) -> torch.Tensor:
        # what the default step trains: the mean of its micro-batches' losses
        parts = bb.split(setting.micro)
        return sum((loss_of(m, p) for p in parts), torch.zeros(())) / len(parts)

    def fallback(m: nn.Module, own: np.ndarray, uses: Uses, where: str) -> Finding:
        reached = input_reached and uses.input_reached() and \
            _input_reaches(m, tie, objective, b)
        why = _differenced(m, uses.least_precise, build.computed, tie, objective, b,
                           own,
                           seed, reached,
                           _reads(m, {}, b), None, CHECK,
                           invariant(setting.steps, target.step is not None))
        return replace(why, detail=f"{where}, against the forward (the uses cannot be "
                                   f"observed: {uses.problem()}): {why.detail}")

    loop = Loop(build.spec, target, tie, loss_of, b, setting.steps, setting.micro, seed,
                build.precision, setting.autocast, setting.compile)
    return run_loop(loop, build.fresh, fallback=fallback)
