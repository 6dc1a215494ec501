"""Does the tie survive what a model goes through, and does an optimizer see it once?

Runs inside the worker process.  Every check builds its own model from the target's factory,
so no check sees another's side effects and the caller's models are never touched.

What torch 2.13.0 does, measured on a plain module tied by assignment
(``head.weight = emb.weight``), which is why the checks below exist:

* ``load_state_dict(sd, assign=True)`` leaves two Parameter objects over one storage (the
  state dict's two entries share it, also through ``torch.save``/``torch.load``): ``is``
  fails, ``data_ptr`` agrees, each gets only its own path's gradient, and
  ``model.parameters()`` lists both (AdamW then keeps two state slots for one matrix).
* ``to_empty(device=...)`` after a meta-device build leaves two Parameters with two storages.
* ``deepcopy``, ``.to(dtype)`` and ``load_state_dict`` without ``assign`` keep the tie.
* An optimizer given the tied Parameter twice in one group only warns ("optimizer contains a
  parameter group with duplicate parameters") and steps it twice (SGD: exactly 2 updates,
  AdamW: 1.999); the same Parameter in two groups raises ``ValueError`` ("some parameters
  appear in more than one parameter group").
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.diagnosis import Label
from tyingspec._src.core.findings import Finding, failed, not_applicable, passed
from tyingspec._src.core.tolerance import epsilon_of, smallest_normal
from tyingspec._src.kinds.torch.tables import table_parameters

Retie = Callable[[nn.Module], None]

_TIED = "the embedding and the head are one Parameter with one storage"
_TIED_SAVED = _TIED + ", holding the saved values"
_ONCE = ("the tied Parameter is in the optimizer's parameter groups exactly once, has at most "
         "one state slot, and one step moves it by exactly one update")

#: The closed-form first step is computed in float64 from the values the optimizer stepped
#: from; the optimizer's own step rounds at the parameter's dtype (machine epsilon ``eps``):
#: at most a rounding of the parameter and one of the decayed parameter (``_ROUNDINGS_P`` eps
#: of it bounds them twice over), and a handful in the update (``_ROUNDINGS_UPDATE`` eps of
#: the update's terms: the moments, the square root, the division).  Kept tight on the
#: parameter so that a second update stays visible at bfloat16, where one AdamW update is a
#: few percent of an entry.
_ROUNDINGS_P = 4.0
_ROUNDINGS_UPDATE = 16.0


def _storage(p: torch.Tensor) -> int:
    return int(p.untyped_storage().data_ptr())


def _untied(model: nn.Module, embedding: str, head: str) -> str | None:
    """What the two names have become if they are not one Parameter, else None."""
    try:
        e = model.get_parameter(embedding)
        h = model.get_parameter(head)
    except AttributeError as exc:
        return f"a name no longer resolves to a Parameter ({exc})"
    if e is h:
        return None
    if _storage(e) == _storage(h):
        return (f"{embedding} and {head} are two Parameters over one storage "
                f"(0x{_storage(e):x}): each gets only its own path's gradient and "
                f"model.parameters() lists both, so an optimizer keeps two states and "
                f"steps the matrix twice, once per path")
    return (f"{embedding} and {head} are two Parameters "
            f"(storages 0x{_storage(e):x} and 0x{_storage(h):x})")


def _retie_of(model: nn.Module, retie: Retie | None) -> tuple[Retie, str] | None:
    """The re-tie to use on ``model`` and how a detail names it; None when there is none."""
    if retie is not None:
        return retie, "the target's retie"
    own = getattr(model, "tie_weights", None)
    if callable(own):
        return _own_tie_weights, "tie_weights()"
    return None


def _own_tie_weights(model: nn.Module) -> None:
    cast(Callable[[], None], model.tie_weights)()


def _no_retie(what: str) -> str:
    return (f"the model has no tie_weights() and the target gives no retie; {what} replaces "
            f"the two Parameters separately, so such a model is untied by it — re-tie by "
            f"hand after it")


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _marked(model: nn.Module, embedding: str) -> torch.Tensor:
    """Shift the tied matrix so a load that keeps the fresh model's own values is caught
    even when the factory seeds itself (two factory models are then equal)."""
    p = model.get_parameter(embedding)
    with torch.no_grad():
        p.add_(torch.linspace(1.0, 2.0, p.numel(), dtype=p.dtype).reshape(p.shape))
    return p.detach().clone()


def _tied_finding(check: str, invariant: str, model: nn.Module, embedding: str, head: str,
                  after: str, saved: torch.Tensor | None = None) -> Finding:
    untied = _untied(model, embedding, head)
    if untied is not None:
        return failed(check, invariant, "tie_lost", f"after {after}, {untied}")
    if saved is not None:
        got = model.get_parameter(embedding).detach()
        if got.shape != saved.shape or not torch.equal(got, saved.to(got.dtype)):
            diff = ("shape " + str(tuple(got.shape)) if got.shape != saved.shape else
                    f"max |diff| {float((got - saved.to(got.dtype)).abs().max()):.3g}")
            return failed(check, invariant, "tie_lost",
                          f"after {after}, {embedding} is one Parameter with {head} but does "
                          f"not hold the saved values ({diff})")
    return passed(check, invariant)


def _saved_state(model: nn.Module) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state: dict[str, Any] = torch.load(buf, weights_only=True)
    return state


def at_precision(factory: Callable[[], nn.Module],
                 dtype: torch.dtype | None) -> Callable[[], nn.Module]:
    """``factory`` building its models at the run's precision: converted to ``dtype`` (the
    ``--precision`` asked for) where the model converts, else as built, as the run's own
    models are (a float64 model the run never trains in can give a NaN gradient that the run's
    float32 one does not: LED's and Longformer's padded attention)."""
    if dtype is None:
        return factory

    def build() -> nn.Module:
        model = factory()
        try:
            return model.to(dtype)
        except Exception:  # noqa: BLE001  (a model that cannot convert keeps its own dtype)
            return model
    return build


def identity_findings(factory: Callable[[], nn.Module], embedding: str, head: str, *,
                      retie: Retie | None,
                      loss_of: Callable[[nn.Module], torch.Tensor],
                      dtype: torch.dtype | None = None) -> list[Finding]:
    """Whether the tie (one Parameter, one storage) survives each transformation a model goes
    through: deepcopy, ``.to(float64)``, a state-dict load (plain and ``assign=True`` + re-tie),
    a safetensors round trip, meta-device init + ``to_empty`` + re-tie, a vocabulary resize
    and one optimizer step; one :class:`Finding` per transformation, each on fresh models
    built at the run's precision (``dtype``, see :func:`at_precision`)."""
    factory = at_precision(factory, dtype)
    checks: list[tuple[str, str, Callable[[], Finding]]] = [
        ("identity after deepcopy", _TIED,
         lambda: _tied_finding("identity after deepcopy", _TIED,
                               copy.deepcopy(factory()), embedding, head, "copy.deepcopy")),
        ("identity after .to(torch.float64)", _TIED,
         lambda: _tied_finding("identity after .to(torch.float64)", _TIED,
                               factory().to(torch.float64), embedding, head,
                               ".to(torch.float64)")),
        ("identity after load_state_dict", _TIED_SAVED,
         lambda: _load_plain(factory, embedding, head)),
        ("identity after load_state_dict(assign=True) + re-tie", _TIED_SAVED,
         lambda: _load_assign(factory, embedding, head, retie)),
        ("identity after a safetensors round trip", _TIED_SAVED,
         lambda: _safetensors(factory, embedding, head)),
        ("identity after meta-device init + to_empty() + re-tie", _TIED,
         lambda: _meta(factory, embedding, head, retie)),
        ("identity after resize_token_embeddings", _TIED + ", with the new vocabulary's rows",
         lambda: _resize(factory, embedding, head)),
        ("identity after one optimizer step", _TIED,
         lambda: _stepped(factory, embedding, head, loss_of)),
    ]
    findings = []
    for check, invariant, run in checks:
        try:
            findings.append(run())
        except Exception as exc:  # a crash is reported, not propagated
            # The transformation itself failed, so the invariant could not be looked at.
            findings.append(not_applicable(check, invariant,
                                           f"the transformation raised {_raised(exc)}"))
    return findings


def _load_plain(factory: Callable[[], nn.Module], embedding: str, head: str) -> Finding:
    source = factory()
    saved = _marked(source, embedding)
    fresh = factory()
    fresh.load_state_dict(_saved_state(source))
    return _tied_finding("identity after load_state_dict", _TIED_SAVED, fresh, embedding, head,
                         "torch.save/torch.load + load_state_dict", saved)


def _load_assign(factory: Callable[[], nn.Module], embedding: str, head: str,
                 retie: Retie | None) -> Finding:
    check = "identity after load_state_dict(assign=True) + re-tie"
    source = factory()
    saved = _marked(source, embedding)
    fresh = factory()
    how = _retie_of(fresh, retie)
    if how is None:
        return not_applicable(check, _TIED_SAVED, _no_retie("load_state_dict(assign=True)"))
    fresh.load_state_dict(_saved_state(source), assign=True)
    how[0](fresh)
    return _tied_finding(check, _TIED_SAVED, fresh, embedding, head,
                         f"load_state_dict(assign=True) + {how[1]}", saved)


def _safetensors(factory: Callable[[], nn.Module], embedding: str, head: str) -> Finding:
    check = "identity after a safetensors round trip"
    try:
        from safetensors.torch import load_model, save_model
    except ImportError:
        return not_applicable(check, _TIED_SAVED,
                              "safetensors is not installed: pip install safetensors")
    source = factory()
    saved = _marked(source, embedding)
    fresh = factory()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_model(source, path)
        load_model(fresh, path)
    return _tied_finding(check, _TIED_SAVED, fresh, embedding, head,
                         "safetensors save_model/load_model", saved)


def _meta(factory: Callable[[], nn.Module], embedding: str, head: str,
          retie: Retie | None) -> Finding:
    check = "identity after meta-device init + to_empty() + re-tie"
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # e.g. data-dependent init has no meta kernel
        return not_applicable(check, _TIED, f"the factory cannot build on the meta device: "
                                            f"{_raised(exc)}")
    how = _retie_of(model, retie)
    if how is None:
        return not_applicable(check, _TIED, _no_retie("to_empty()"))
    model.to_empty(device="cpu")
    how[0](model)
    return _tied_finding(check, _TIED, model, embedding, head,
                         f"meta-device init + to_empty(device='cpu') + {how[1]}")


def _parameters(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _resize(factory: Callable[[], nn.Module], embedding: str, head: str) -> Finding:
    check = "identity after resize_token_embeddings"
    invariant = _TIED + ", with the new vocabulary's rows"
    model = factory()
    resize = getattr(model, "resize_token_embeddings", None)
    if not callable(resize):
        return not_applicable(check, invariant,
                              "the model has no resize_token_embeddings() method")
    rows, width = model.get_parameter(embedding).shape
    # transformers' mean_resizing draws the new rows from the old ones' covariance and says so
    # on stderr; the tie is what is checked, so plain initialisation is asked for when offered
    quiet = {"mean_resizing": False} if "mean_resizing" in _parameters(resize) else {}
    resize(rows + 8, **quiet)
    after = f"resize_token_embeddings({rows + 8})"
    untied = _untied(model, embedding, head)
    if untied is not None:
        return failed(check, invariant, "tie_lost", f"after {after}, {untied}")
    shape = tuple(model.get_parameter(head).shape)
    if shape != (rows + 8, width):
        return failed(check, invariant, "tie_lost",
                      f"after {after}, {head} has shape {shape}, not {(rows + 8, width)}")
    return passed(check, invariant)


def _stepped(factory: Callable[[], nn.Module], embedding: str, head: str,
             loss_of: Callable[[nn.Module], torch.Tensor]) -> Finding:
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.autograd.backward(loss_of(model))
    opt.step()
    return _tied_finding("identity after one optimizer step", _TIED, model, embedding, head,
                         "one SGD step")


def optimizer_findings(factory: Callable[[], nn.Module], embedding: str, head: str, *,
                       optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None,
                       loss_of: Callable[[nn.Module], torch.Tensor],
                       spec: str = "", dtype: torch.dtype | None = None) -> list[Finding]:
    """Whether SGD, AdamW and the target's own optimizer (if given) hold the tied Parameter
    exactly once, keep at most one state slot for it, and move it by exactly one update in
    one step (compared with the closed-form first step where the optimizer is known), on a
    model built at the run's precision (``dtype``, see :func:`at_precision`).  A tied table
    computed by a parametrization is held by the optimizer as its Parameters (the
    parametrization's originals): each of them is checked."""
    builds: list[tuple[str, Callable[[nn.Module], torch.optim.Optimizer]]] = [
        ("optimizer SGD", lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
        ("optimizer AdamW",
         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)),
    ]
    if optimizer is not None:
        builds.append(("optimizer from the target", optimizer))
    factory = at_precision(factory, dtype)
    findings = []
    for check, build in builds:
        try:
            findings.append(_one_optimizer(check, build, factory, embedding, head, loss_of))
        except Exception as exc:  # a crash is reported, not propagated
            if build is optimizer:
                # the user's own optimizer failing is never a pass: an adapter error (exit 2)
                raise AdapterError(spec, "the target's optimizer raised", key="optimizer",
                                   got=_raised(exc)) from exc
            findings.append(not_applicable(check, _ONCE, f"the check raised {_raised(exc)}"))
    return findings


def _one_optimizer(check: str, build: Callable[[nn.Module], torch.optim.Optimizer],
                   factory: Callable[[], nn.Module], embedding: str, head: str,
                   loss_of: Callable[[nn.Module], torch.Tensor]) -> Finding:
    model = factory()
    untied = _untied(model, embedding, head)
    if untied is not None:
        return not_applicable(check, _ONCE, f"the tie is already lost as built: {untied}")
    names = table_parameters(model, embedding)
    params = [model.get_parameter(n) for n in names]
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = build(model)
        except Exception as exc:  # torch refuses some duplicates outright
            if _about_duplicates(str(exc)):
                return failed(check, _ONCE, "optimizer_sees_tie_twice",
                              f"building the optimizer raised {_raised(exc)}")
            raise
    problems += [f"torch warned: {w.message}" for w in caught
                 if _about_duplicates(str(w.message))]
    held: list[int] = []
    for name, p in zip(names, params):
        listed = _listed(opt, p)
        if listed is None:
            return failed(check, _ONCE, "unknown", f"{name} is in none of the optimizer's "
                                                   f"parameter groups: a step never trains it")
        held.append(listed[0])
        problems += [f"{_who(name, names)}{problem}" for problem in listed[1]]

    torch.autograd.backward(loss_of(model))
    if any(p.grad is None for p in params):
        missing = next(n for n, p in zip(names, params) if p.grad is None)
        return not_applicable(check, _ONCE, f"loss_of gives {missing} no gradient")
    # Where the step starts: the forward may have written the table in place
    # (nn.Embedding(max_norm=...) renormalises the rows it reads), and the optimizer steps
    # from those values.
    starts = [p.detach().clone() for p in params]
    grads = [cast(torch.Tensor, p.grad).detach().clone() for p in params]
    opt.step()

    notes: list[str] = []
    moves: list[float] = []
    judged = False
    for name, p, p0, grad, group in zip(names, params, starts, grads, held):
        slots = sum(1 for k in opt.state if k is p)
        shared = sum(1 for k in opt.state
                     if k is not p and isinstance(k, torch.Tensor) and _storage(k) == _storage(p))
        if slots > 1 or shared:
            problems.append(f"{_who(name, names)}after one step it has {slots + shared} "
                            "optimizer state slots")
        expected = _first_step(opt, opt.param_groups[group], p0, grad)
        if expected is None:
            notes.append(f"{_who(name, names)}update size not checked ({type(opt).__name__} "
                         "has no closed form here)")
            judged = True
            continue
        compared = _compare(p.detach(), p0, grad, *expected)
        notes.append(_who(name, names) + compared.detail)
        judged = judged or compared.judged
        if compared.moved is not None:
            moves.append(compared.moved)
    detail = "; ".join([*problems, *notes])
    if not moves and not problems:
        return passed(check, _ONCE, detail) if judged else not_applicable(check, _ONCE, detail)
    # A wrong update that is no multiple of one is some other bug than a second update.
    label: Label = ("unknown" if not problems and moves and max(moves) < 1.5
                    else "optimizer_sees_tie_twice")
    return failed(check, _ONCE, label, detail)


def _listed(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, list[str]] | None:
    """The group ``p`` is stepped in and what is wrong with how the optimizer holds it; None
    when no group holds it."""
    groups = [i for i, g in enumerate(opt.param_groups) for q in g["params"] if q is p]
    if not groups:
        return None
    problems = []
    if len(groups) > 1:
        where = ", ".join(f"{groups.count(i)} in group {i}" for i in sorted(set(groups)))
        problems.append(f"the tied Parameter is listed {len(groups)} times ({where})")
    aliases = sum(1 for g in opt.param_groups for q in g["params"]
                  if q is not p and _storage(q) == _storage(p))
    if aliases:
        problems.append(f"{aliases} other parameter(s) share its storage")
    return groups[0], problems


def _who(name: str, names: list[str]) -> str:
    """A detail's prefix naming which of a parametrized table's Parameters it is about."""
    return f"{name}: " if len(names) > 1 else ""


def _about_duplicates(message: str) -> bool:
    # torch's wording: "duplicate parameters" (one group, a warning) and "appear in more than
    # one parameter group" (two groups, a ValueError).
    text = message.lower()
    return "duplicate" in text or "more than one parameter group" in text


def _first_step(opt: torch.optim.Optimizer, group: dict[str, Any], p0: torch.Tensor,
                grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype] | None:
    """The closed-form first step from ``p0`` with gradient ``grad``, computed in float64,
    the magnitude of the update's terms (its roundoff grows with them) and the dtype the
    optimizer computed in; None for an optimizer not known here."""
    dtype = p0.dtype
    p0, grad = p0.double(), grad.double()
    lr = float(group["lr"])
    wd = float(group.get("weight_decay", 0.0))
    g = -grad if group.get("maximize", False) else grad
    if type(opt) is torch.optim.SGD:
        d = g + wd * p0
        momentum = float(group.get("momentum", 0.0))
        # At step 1 the momentum buffer is the gradient itself (dampening is not applied);
        # Nesterov then adds momentum times it once more.
        if momentum and group.get("nesterov", False):
            d = d * (1.0 + momentum)
        terms = lr * (grad.abs() + wd * p0.abs()) * (1.0 + momentum)
        return p0 - lr * d, terms, dtype
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = (type(opt) is torch.optim.AdamW
                     or bool(group.get("decoupled_weight_decay", False)))
        eps = float(group["eps"])
        base = p0 * (1.0 - lr * wd) if decoupled else p0
        if not decoupled:
            g = g + wd * p0
        # Bias corrections cancel at step 1: m/(1-b1) = g and sqrt(v/(1-b2)) = |g|
        # (amsgrad's running max is v itself at step 1).
        update = lr * g / (g.abs() + eps)
        return base - update, update.abs() + lr * wd * p0.abs(), dtype
    return None


@dataclass(frozen=True)
class _Compared:
    detail: str
    moved: float | None  # updates moved, None when it is the one update
    judged: bool  # some entry could tell one update from two


def _compare(new: torch.Tensor, p0: torch.Tensor, grad: torch.Tensor, expected: torch.Tensor,
             terms: torch.Tensor, dtype: torch.dtype) -> _Compared:
    """The step the optimizer took against the closed form, entry by entry, with bounds from
    the dtype it stepped in.  Entries where the model's own gradient is not finite are left
    out and said so (a NaN the model's backward produces is no tie bug, and the closed form
    of a NaN is NaN), as are entries the optimizer's step left non-finite where the closed
    form is finite (an ``eps`` below the dtype's range: float16 AdamW divides 0 by 0)."""
    new, p0 = new.double(), p0.double()
    eps = epsilon_of(dtype)
    notes: list[str] = []
    bad_grad = ~torch.isfinite(grad)
    if bool(bad_grad.any()):
        notes.append(f"the model's own gradient is not finite at {_dtype(dtype)} in "
                     f"{_non_finite(grad)}: its backward produces them on this batch, which "
                     "is no tie bug (a step on them corrupts the weights); those entries are "
                     "left out of the comparison")
    finite = torch.isfinite(expected) & ~bad_grad
    bad_step = finite & ~torch.isfinite(new)
    if bool(bad_step.any()):
        notes.append(f"the step left {int(bad_step.sum())} of {new.numel()} entries "
                     f"non-finite where the closed-form update is finite: left out (the "
                     f"optimizer at {_dtype(dtype)}, not the tie)")
    keep = finite & ~bad_step
    if not bool(keep.any()):
        return _Compared("; ".join([*notes, "no entry left to compare the update on"]), None,
                         False)
    update = (expected - p0)[keep]
    tol = (_ROUNDINGS_P * eps * p0.abs() + _ROUNDINGS_UPDATE * eps * terms)[keep] + \
        smallest_normal(dtype)
    diff = (new - expected)[keep]
    if bool((diff.abs() <= tol).all()):
        if not bool((update.abs() > tol).any()):
            # one update is within the dtype's rounding everywhere: two would pass as well
            return _Compared("; ".join([*notes, f"one update is within {_dtype(dtype)}'s "
                                        "rounding of every entry, so a second update could "
                                        "not be told from one"]), None, False)
        return _Compared("; ".join(["moved by exactly one update", *notes]), None, True)
    norm2 = float((update * update).sum())
    if norm2 == 0.0 or not math.isfinite(norm2):
        worst = float(diff.abs().max())
        return _Compared("; ".join([f"moved although the closed-form update is zero (max "
                                    f"|diff| {worst:.3g})", *notes]), 0.0, True)
    # Project the actual move onto the expected update: 2.00 means it was stepped twice.
    moved = float(((new - p0)[keep] * update).sum()) / norm2
    return _Compared("; ".join([f"moved by {moved:.2f} updates in one step", *notes]), moved,
                     True)


def _non_finite(t: torch.Tensor) -> str:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    kinds = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
    return f"{nan + inf} of {t.numel()} entries ({kinds})"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
