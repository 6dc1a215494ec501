"""The training loop, judged at every step: the user's own step, or the check's default one.

``TorchTarget(step=...)`` is the user's training step as they run it: forward, their loss
with their masks and labels, backward under their autocast or compile, accumulation over
their micro-batches, clipping, ``optimizer.step()``.  Without one, the check runs its own:
the case's micro-batches through the case's loss path, each ``backward`` of ``loss / k``, then
one optimizer step.  Either way, each step:

1. runs whole under :func:`kinds.torch.uses.observed_uses` (its backward and the optimizer's
   update are not uses), so every forward it takes leaves its ``dx``, ``h`` and ``g``: the
   reference is their sum, whatever the step's accumulation, loss scaling or masks;
2. reads the tied gradient the optimizer steps with (an optimizer step pre-hook), or what is
   left after the step when it never steps; a uniform rescaling applied to every gradient
   after the backward (``clip_grad_norm_``, a ``GradScaler``'s unscale) is measured on
   another parameter and divided out, and nothing else is;
3. judges that gradient row by row against the reference (a gradient that is the previous
   step's plus this one's is ``gradient_not_zeroed``, the last micro-batch's alone is
   ``gradient_assigned``), and the update the optimizer made against one replayed on a copy
   of the tied weight with the same state (twice the update is ``optimizer_sees_tie_twice``).

The number of steps is the case's (drawn past three: a bug that starts after the fifth forward
shows).  Under ``compile`` the model the step trains is compiled and its twin, built from the
same seed, runs the same step eagerly under observation: the twin gives the reference, the
compiled model the gradient judged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.core.cases import kernel_paths
from tyingspec._src.core.diagnosis import diagnose
from tyingspec._src.core.findings import Finding, failed, not_applicable, passed
from tyingspec._src.core.tolerance import epsilon_of
from tyingspec._src.kinds.torch.batch import TorchBatch, model_device
from tyingspec._src.kinds.torch.discover import Loss, Tie
from tyingspec._src.kinds.torch.tables import tied_grad_of
from tyingspec._src.kinds.torch.target import StepBatch, TorchTarget
from tyingspec._src.kinds.torch.uses import Uses, observed_uses

CHECK = "gradient at every training step"


def invariant(steps: int, user: bool) -> str:
    whose = "your step's" if user else "each step's"
    return (f"at each of {steps} optimizer steps, the tied gradient the optimizer steps with is "
            f"the sum of both paths over {whose} forwards, row by row, and the optimizer "
            "moves the tied weight by one update")


@dataclass
class _Seen:
    """What one step left: the tied gradient the optimizer was handed, the witness's raw and
    stepped gradients (for a rescaling of every gradient), the tied weight before and after
    the update and the optimizer's state for it."""

    grad: torch.Tensor | None = None
    # the Parameter's own .grad, what the optimizer steps it with: the judged gradient but for
    # a parametrized table, whose judged gradient is dL/dW (see kinds.torch.tables)
    step_grad: torch.Tensor | None = None
    raw_witness: torch.Tensor | None = None
    witness: torch.Tensor | None = None
    before: torch.Tensor | None = None
    after: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)
    group: dict[str, Any] = field(default_factory=dict)
    stepped: int = 0


def _witness(model: nn.Module, E: torch.Tensor) -> torch.Tensor | None:
    """Another trainable parameter: what a rescaling of every gradient is measured on."""
    return max((p for p in model.parameters() if p is not E and p.requires_grad
                and p.is_floating_point()), key=lambda p: p.numel(), default=None)


class _Watch:
    """Hooks that record a step's tied gradient and update (see :class:`_Seen`)."""

    def __init__(self, model: nn.Module, E: torch.Tensor, optimizer: Any) -> None:
        self.E, self.optimizer, self.model = E, optimizer, model
        self.w = _witness(model, E)
        self.seen = _Seen()
        self.pause: Callable[[], None] = lambda: None
        self.resume: Callable[[], None] = lambda: None
        self.handles: list[Any] = []
        if self.w is not None:
            self.handles.append(self.w.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                self._raw))
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.handles.append(optimizer.register_step_pre_hook(self._pre))
            self.handles.append(optimizer.register_step_post_hook(self._post))

    def _raw(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.seen.raw_witness = p.grad.detach().clone()

    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.pause()
        s = self.seen
        s.stepped += 1
        if s.stepped > 1:
            return
        s.grad, s.step_grad = _grads(self.model, self.E)
        s.witness = None if self.w is None or self.w.grad is None else \
            self.w.grad.detach().clone()
        s.before = self.E.detach().clone()
        s.state = copy.deepcopy(dict(opt.state.get(self.E, {})))
        s.group = next(({k: v for k, v in g.items() if k != "params"}
                        for g in opt.param_groups if any(p is self.E for p in g["params"])),
                       {})

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.seen.stepped == 1:
            self.seen.after = self.E.detach().clone()
        self.resume()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _grads(model: nn.Module, E: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The tied gradient to judge and the one the optimizer steps ``E`` with, copied."""
    judged = tied_grad_of(model, E)
    return (None if judged is None else judged.detach().clone(),
            None if E.grad is None else E.grad.detach().clone())


def _scale(seen: _Seen) -> float:
    """The factor every gradient was rescaled by between the backward and the optimizer's
    step, measured on the witness: 1 where it was not, or where the witness changed otherwise
    (then nothing is divided out)."""
    w, raw = seen.witness, seen.raw_witness
    if w is None or raw is None:
        return 1.0
    a, b = w.double().reshape(-1), raw.double().reshape(-1)
    bb = float(b @ b)
    if bb == 0.0:
        return 1.0
    c = float(a @ b) / bb
    unit = epsilon_of(w.dtype)
    ok = bool(torch.all((a - c * b).abs() <= 64 * unit * (a.abs() + abs(c) * b.abs()) + 1e-300))
    return c if ok and c > 0 else 1.0


def default_step(loss_of: Loss, micro: int) -> Callable[[nn.Module, Any, TorchBatch], None]:
    """The check's own step: ``zero_grad()``, ``micro`` micro-batches, each ``backward`` of
    ``loss / k``, then the optimizer's step."""
    def step(model: nn.Module, optimizer: Any, batch: TorchBatch) -> None:
        optimizer.zero_grad()
        parts = batch.split(micro)
        for part in parts:
            (loss_of(model, part) / len(parts)).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return step


def _as_step_batch(batch: TorchBatch) -> StepBatch:
    return StepBatch(batch.tokens, batch.targets, batch.mask)


@dataclass(frozen=True)
class Loop:
    """One training loop a case runs (see :func:`run_loop`)."""

    spec: str
    target: TorchTarget
    tie: Tie
    loss_of: Loss  # the case's loss path, autocast and after_backward included
    batch: TorchBatch
    steps: int
    micro: int
    seed: int
    precision: str  # the dtype the gradient is judged at
    autocast: str = ""
    compile: str = ""
    check: str = CHECK  # the finding's name and invariant (the micro-batch check runs one step)
    invariant: str = ""
    user_step: bool = True  # False: the check's own step even where the target has one


Fallback = Callable[[nn.Module, np.ndarray, Any, str], Finding]


def run_loop(loop: Loop, fresh: Callable[[], nn.Module], fallback: Fallback | None = None
             ) -> Finding:
    """Train ``loop.steps`` steps of the user's step (or :func:`default_step`) on a fresh
    model and judge each (see the module docstring); the first wrong step is the finding."""
    user = loop.target.step is not None and loop.user_step
    inv = loop.invariant or invariant(loop.steps, user)
    check = loop.check
    model = fresh()
    twin = fresh() if loop.compile else None  # the eager model the reference comes from
    if loop.compile:
        model.compile(backend=loop.compile, dynamic=True)
    optimizers = [_optimizer(loop, m) for m in (model, twin) if m is not None]
    run = _user_step(loop) if user else default_step(loop.loss_of, loop.micro)
    E = model.get_parameter(loop.tie.embedding)
    previous: np.ndarray | None = None
    scale = 1.0
    powered: list[str] = []  # the precisions of the steps whose rows could tell
    for step in range(1, loop.steps + 1):
        # the weights this step's gradient is taken at, for a step whose uses cannot be
        # observed: the fallback differences the loss there, not at the weights it moved to
        before = {k: v.detach().clone() for k, v in model.state_dict().items()} \
            if fallback is not None and twin is None and not user else None
        if twin is not None:
            torch.manual_seed(loop.seed + 7 * step)
            _, uses = _one_step(run, twin, optimizers[1], loop.batch,
                                twin.get_parameter(loop.tie.embedding), observe=True)
            torch.manual_seed(loop.seed + 7 * step)
            seen, _ = _one_step(run, model, optimizers[0], loop.batch, E, observe=False)
        else:
            torch.manual_seed(loop.seed + 7 * step)
            seen, uses = _one_step(run, model, optimizers[0], loop.batch, E, observe=True)
        where = f"step {step} of {loop.steps}"
        if seen.grad is None:
            return failed(check, inv, "input_path_missing" if step == 1 else "unknown",
                          f"{where}: the tied weight has no gradient when the optimizer steps")
        problem = uses.problem()
        if problem is not None and before is not None and fallback is not None:
            with torch.no_grad():
                model.load_state_dict(before)
            return fallback(model, seen.grad.double().cpu().numpy(), uses, where)
        if problem is not None:
            return not_applicable(check, inv, f"{where}: a use of the tied weight cannot be "
                                  f"observed in {'your' if user else 'the'} step ({problem}); "
                                  "the gradient against the forward judged the model instead")
        scale = _scale(seen)
        own = seen.grad.double().cpu().numpy() / scale
        ids, dx, h, g = observed_arrays(uses, loop.tie)
        paths = kernel_paths(ids, dx, h, g, loop.tie.vocab, "float64")
        # the precision the step computed in: the case's, or lower where the step's own
        # autocast ran its uses in bfloat16
        at = replace(loop, precision=lower(loop.precision, uses.least_precise))
        diag = diagnose(own, paths, dtype=at.precision)
        if diag.label != "no_power" or _overall_power(paths, at.precision):
            powered.append(at.precision)
        if not diag.wrong and at.precision in ("bfloat16", "float16"):
            # at a low precision a row's bound can exceed a whole path: the gradient is judged
            # over every entry at once too, where rounding averages out
            found = _overall(own, paths, previous, uses, loop, at.precision, where)
            if found is not None:
                return failed(check, inv, *found)
        if diag.wrong:
            return failed(check, inv, *_stateful(diag, own, paths, previous, uses, at, where))
        update = _update(seen, optimizers[0], E)
        if update is not None:
            return failed(check, inv, update[0], f"{where}: {update[1]}")
        # what the optimizer was handed (after any clipping): what a buffer never zeroed keeps
        previous = seen.grad.double().cpu().numpy()
    clipped = "" if scale == 1.0 else f"; every gradient rescaled by {scale:.6g} before the " \
        "optimizer's step (clipping or unscaling), divided out"
    how = f"{loop.steps} steps of {'your step' if user else _default_words(loop)}" \
        f" with {type(optimizers[0]).__name__}"
    if loop.compile:
        how += f", compiled ({loop.compile}) against its eager twin"
    if not powered:
        how += (f"; judged at {at.precision}, whose rounding bound is wider than a dropped "
                "path at this batch: these rows had no power")
    elif at.precision in ("bfloat16", "float16"):
        how += f"; judged at {at.precision}, row by row and over every entry at once"
    return passed(check, inv, how + clipped, power=bool(powered))


def lower(precision: str, dtype: torch.dtype) -> str:
    """The less precise of a precision's name and a torch dtype."""
    other = getattr(torch, precision)
    return str(dtype if dtype.itemsize < other.itemsize else other).removeprefix("torch.")


def _overall_power(paths: Any, precision: str) -> bool:
    """Whether the judgement over every entry (:func:`_overall`) could tell either path
    missing: each is more than its tolerance of the whole."""
    if precision not in ("bfloat16", "float16"):
        return False
    tol = 8 * epsilon_of(precision)
    ref_in, ref_out = paths.dE_in, np.asarray(paths.dE_out)
    size = float(np.linalg.norm(ref_in + ref_out)) or 1.0
    return min(float(np.linalg.norm(ref_in)), float(np.linalg.norm(ref_out))) > tol * size


def _overall(own: np.ndarray, paths: Any, previous: np.ndarray | None, uses: Any, loop: Loop,
             precision: str, where: str) -> tuple[Any, str] | None:
    """A wrong gradient every row of which is within its low-precision bound: the relative
    error over all entries against 8 eps of ``precision``, and what explains it (the previous
    step's gradient left in, the last forward's alone, one copy per repeated token, a path's
    stray factor); None when it is within."""
    ref = paths.dE_in + np.asarray(paths.dE_out)
    tol = 8 * epsilon_of(precision)
    size = float(np.linalg.norm(ref)) or 1.0

    def off(x: np.ndarray) -> float:
        return float(np.linalg.norm(own - x)) / size

    if off(ref) <= tol:
        return None
    how = f"{where}: the tied gradient is off by {off(ref):.3g} of its size over all entries"
    if previous is not None and off(ref + previous) <= tol:
        return "gradient_not_zeroed", (f"{how}: it is the previous step's plus this one's, "
                                       "never zeroed between steps")
    lookups, heads = uses.lookups, uses.heads
    if len(lookups) > 1 and len(lookups) == len(heads):
        last = replace(uses, lookups=lookups[-1:], heads=heads[-1:])
        ids, dx, h, g = observed_arrays(last, loop.tie)
        alone = kernel_paths(ids, dx, h, g, loop.tie.vocab, "float64")
        if off(alone.dE_in + np.asarray(alone.dE_out)) <= tol:
            return "gradient_assigned", (f"{how}: it is the last of {len(lookups)} forwards' "
                                         "alone, assigned (`.grad =`), not added")
    ids, dx, h, g = observed_arrays(uses, loop.tie)
    scaled = path_factors(own, ids, dx, h, g, loop.tie.vocab, precision)
    if scaled is not None:
        return "path_scaled", f"{how}: {scaled}"
    return "unknown", f"{how} (each row is within its {precision} bound alone)"


def _default_words(loop: Loop) -> str:
    return f"{loop.micro} micro-batch{'es' if loop.micro > 1 else ''}"


def _optimizer(loop: Loop, model: nn.Module) -> Any:
    try:
        return loop.target.optimizer(model) if loop.target.optimizer is not None else \
            torch.optim.SGD(model.parameters(), lr=1e-2)
    except Exception as exc:
        raise AdapterError(loop.spec, "the target's optimizer raised", key="optimizer",
                           got=f"{type(exc).__name__}: {exc}") from exc


def _user_step(loop: Loop) -> Callable[[nn.Module, Any, TorchBatch], None]:
    step = loop.target.step
    assert step is not None
    autocast = loop.autocast

    def run(model: nn.Module, optimizer: Any, batch: TorchBatch) -> None:
        device = model_device(model)
        given = _as_step_batch(batch.to(device))
        try:
            if autocast:
                with torch.autocast(device.type, dtype=getattr(torch, autocast)):
                    step(model, optimizer, given)
            else:
                step(model, optimizer, given)
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(loop.spec, "the target's step raised", key="step",
                               got=f"{type(exc).__name__}: {exc}") from exc
    return run


def _one_step(run: Callable[[nn.Module, Any, TorchBatch], None], model: nn.Module,
              optimizer: Any, batch: TorchBatch, E: torch.Tensor, *, observe: bool
              ) -> tuple[_Seen, Any]:
    """One step of ``run``: what it left (see :class:`_Watch`), and the uses it took when
    ``observe``."""
    watch = _Watch(model, E, optimizer)
    uses = Uses()
    try:
        if observe:
            observer = observed_uses(E)
            watch.pause, watch.resume = observer.pause, observer.resume
            with observer as uses:
                run(model, optimizer, batch)
        else:
            run(model, optimizer, batch)
    finally:
        watch.close()
    seen = watch.seen
    if seen.stepped == 0:
        seen.grad, seen.step_grad = _grads(model, E)
    return seen, uses


def observed_arrays(uses: Any, tie: Tie
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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


def _stateful(diag: Any, own: np.ndarray, paths: Any, previous: np.ndarray | None, uses: Any,
              loop: Loop, where: str) -> tuple[Any, str]:
    """The label of a wrong step: the previous step's gradient left in (never zeroed), the
    last forward's alone (assigned, not accumulated), else the rows' own label."""
    rows = f"rows {diag.wrong_rows[:16]} wrong ({diag.detail})"
    if previous is not None and not diagnose(own - previous, paths,
                                             dtype=loop.precision).wrong:
        return "gradient_not_zeroed", (f"{where}: the tied gradient is the previous step's "
                                       "plus this one's: the gradient is never zeroed "
                                       "between steps")
    lookups, heads = uses.lookups, uses.heads
    kept = one_copy(own, uses, loop.tie, loop.precision)
    if kept is not None:
        return "duplicates_not_accumulated", f"{where}: {rows}; {kept}"
    if len(lookups) > 1 and len(lookups) == len(heads):
        last = replace(uses, lookups=lookups[-1:], heads=heads[-1:])
        ids, dx, h, g = observed_arrays(last, loop.tie)
        alone = kernel_paths(ids, dx, h, g, loop.tie.vocab, "float64")
        if not diagnose(own, alone, dtype=loop.precision).wrong:
            return "gradient_assigned", (f"{where}: the tied gradient is the last of "
                                         f"{len(lookups)} forwards' alone: assigned "
                                         "(`.grad =`), not added")
    return diag.label, f"{where}: {rows}"


def one_copy(own: np.ndarray, uses: Any, tie: Tie, precision: str) -> str | None:
    """How ``own`` is explained where some forwards' lookups kept one occurrence of every
    repeated token (numpy's buffered ``+=``, ``index_put_`` without accumulate, a kernel
    switched on after a few forwards); None when it is not.  A row pattern cannot tell that
    from a wrong input path where every token of the batch repeats, nor, at a token read
    hundreds of times, from a missing one; the gradient itself can.  Tried over every subset
    of at most four lookups."""
    lookups = uses.lookups
    if not lookups or all(len(np.unique(u["ids"].numpy())) == len(u["ids"]) for u in lookups):
        return None
    subsets = range(1, 2 ** len(lookups)) if len(lookups) <= 4 else (2 ** len(lookups) - 1,)
    for which in ("last", "first"):
        for subset in subsets:
            one = replace(uses, lookups=[_one_occurrence(u, which) if subset >> i & 1 else u
                                         for i, u in enumerate(lookups)])
            ids, dx, h, g = observed_arrays(one, tie)
            kept = kernel_paths(ids, dx, h, g, tie.vocab, "float64")
            if not diagnose(own, kept, dtype=precision).wrong:
                n = bin(subset).count("1")
                return (f"{n} of {len(lookups)} forwards' lookups kept only the {which} "
                        "occurrence of every repeated token")
    return None


def path_factors(own: np.ndarray, ids: np.ndarray, dx: np.ndarray, h: np.ndarray,
                 g: np.ndarray, V: int, precision: str) -> str | None:
    """A stray factor on one path that the rows cannot show at a low precision (their bound
    grows with the terms of a row; at bfloat16 it can exceed half a path): ``own`` fitted as
    ``a * dE_in + b * dE_out`` over every entry at once, where noise averages out.  Said only
    when the fit explains ``own`` to the precision's rounding and a factor is off 1 by more
    than 8 standard errors and 2^-6; None otherwise."""
    d = own.shape[1]
    dE_in = np.zeros((V, d))
    np.add.at(dE_in, ids, dx)
    X = np.stack([dE_in.ravel(), (g.T @ h).ravel()], axis=1)
    y = np.asarray(own, dtype=np.float64).ravel()
    coef, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
    if rank < 2 or not np.all(np.isfinite(coef)):
        return None
    resid = y - X @ coef
    unit = epsilon_of(precision)
    if float(np.linalg.norm(resid)) > 8 * unit * float(np.linalg.norm(y)):
        return None  # not a scale: the rows' own label says what it is
    sigma2 = float(resid @ resid) / max(len(y) - 2, 1)
    se = np.sqrt(np.maximum(np.diag(sigma2 * np.linalg.pinv(X.T @ X)), 0.0))
    # a floor of 8 eps: arithmetic done wholly in bfloat16 rounds running sums with a bias
    # (seen: a correct bfloat16 nanoGPT fitted x1.017); every stray factor the catalogue
    # knows (1/2, 1/(1-p), 16, sqrt(d)) is far past it
    floor = max(2.0**-6, 8 * unit)
    off = [f"the {name} path enters x{c:.4g}" for name, c, s in
           zip(("input", "output"), coef, se) if abs(c - 1) > max(8 * s, floor)]
    if len(off) == 2 and abs(coef[0] - coef[1]) <= max(8 * float(np.hypot(*se)), floor):
        # both alike: the gradient as a whole is scaled, which no path explains (a loss or a
        # hook scaled the tied gradient beyond what reached its uses)
        return None
    return "; ".join(off) or None


def _one_occurrence(lookup: dict[str, Any], which: str) -> dict[str, Any]:
    """A lookup record whose gradient reaches only the first or last occurrence of each id."""
    ids = lookup["ids"].numpy()
    order = ids if which == "first" else ids[::-1]
    _, at = np.unique(order, return_index=True)
    keep = at if which == "first" else len(ids) - 1 - at
    dx = lookup["dx"]
    mask = torch.zeros(dx.shape[0], 1, dtype=dx.dtype)
    mask[torch.from_numpy(keep)] = 1
    return {**lookup, "dx": dx * mask}


def _update(seen: _Seen, optimizer: Any, E: torch.Tensor) -> tuple[Any, str] | None:
    """The optimizer's update of the tied weight against one replayed on a copy with the same
    gradient, state and settings; None when they agree (or it cannot be replayed)."""
    if seen.stepped == 0 or seen.before is None or seen.after is None or \
            seen.step_grad is None:
        return None
    if seen.stepped > 1:
        return "optimizer_sees_tie_twice", f"the optimizer's step ran {seen.stepped} times"
    try:
        p = nn.Parameter(seen.before.clone())
        p.grad = seen.step_grad.clone()
        replay = type(optimizer)([p], **{k: v for k, v in seen.group.items()
                                          if k not in ("initial_lr",)})
        if seen.state:
            replay.state[p] = copy.deepcopy(seen.state)
        replay.step()
    except Exception:  # noqa: BLE001  (an optimizer that cannot be rebuilt this way)
        return None
    moved = (seen.after - seen.before).double()
    expect = (p.detach() - seen.before).double()
    unit = epsilon_of(E.dtype)
    scale = float(expect.abs().max()) + float(seen.before.double().abs().max()) * unit
    if float((moved - expect).abs().max()) <= 64 * unit * max(scale, 1e-300) + \
            1e-3 * float(expect.abs().max()):
        return None
    if float(expect.abs().max()) > 0 and float((moved - 2 * expect).abs().max()) <= \
            1e-3 * float(expect.abs().max()) + 64 * unit * scale:
        return "optimizer_sees_tie_twice", ("the optimizer moved the tied weight by twice "
                                            "one update (it is in its parameters twice)")
    if float(moved.abs().max()) == 0.0:
        return "tie_lost", ("the optimizer's step left the tied weight where it was: the "
                            "optimizer holds another tensor than the one the model uses")
    return "unknown", (f"the optimizer's update of the tied weight differs from one update "
                       f"(largest difference {float((moved - expect).abs().max()):.3g}, "
                       f"update {float(expect.abs().max()):.3g})")
