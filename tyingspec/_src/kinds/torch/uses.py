"""Every use of the tied Parameter in one forward pass, observed where torch dispatches it.

The reference needs, at each use of ``E``, what the model's own backward cannot fake: at a
lookup, the token ids and the gradient ``dx`` reaching its output; at a head, its input ``h``
and the gradient ``g`` reaching its output.  Module forward hooks see only what passes through
a module's output, which is not ``E[ids]`` when the embedding module scales it (the Gemma
family, BioGpt, ``scale_embedding``), and they miss functional heads (``F.linear(x, wte.weight)``,
torchtune's ``TiedLinear``) and the other lookups of a Parameter three modules share (Bart's
``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``).

So the pass runs under a ``TorchFunctionMode`` that sees every torch function given ``E``, or a
tensor derived from it by a transpose or a dtype cast, and calls it unchanged:

* a lookup: ``F.embedding`` / ``torch.embedding`` (whatever module calls it), ``E[ids]`` and
  ``index_select(E, 0, ids)``; the ids are kept and a hook on the output records ``dx`` (torch
  hands a tensor hook the gradient of the value it was registered on, so an in-place scale
  afterwards, CTRL's ``x *= sqrt(d)``, is accounted for by autograd as it should be);
* a head: ``F.linear(h, E)`` and ``h @ E.T`` (``matmul``, ``mm``, ``@``), with a hook on the
  output recording ``g``;
* a custom ``autograd.Function`` handed ``E`` (a hand-written lookup or fused head): its
  forward runs under no_grad, so it is judged by what it returns: ``E[ids]`` for ids its
  forward looked up is a lookup, ``h @ E.T`` is a head, and the gradient reaching that output
  is recorded whatever the Function's own backward does with it;
* ``nn.Embedding(max_norm=...)``: torch rescales the rows read above ``max_norm`` in place,
  under no_grad, then reads them; the gradient is a plain lookup's of the rescaled table, so
  it is observed as a lookup (the reference takes ``dx``, not E's values);
* a table computed from ``E`` (``torch.nn.utils.parametrize``, whose parametrizations run as
  modules and are seen by global module hooks, or the older ``torch.nn.utils.weight_norm``'s
  ``torch._weight_norm``): what it returns is the table the uses read, tracked as ``E`` is,
  and its own reads of ``E`` are no uses;
* anything else that takes ``E`` and returns a tensor, or a use whose output takes no gradient
  (under ``no_grad``, a detached weight), is a use the reference cannot vouch for: it is
  named, and the check falls back to the model's own backward of each use, checked against
  the forward.

Nothing is replaced: the model computes exactly what it computes without the mode, and its own
backward fills ``E.grad``.  The mode also records the least precise floating dtype any
operation produced, which is the precision the loss is really computed at (transformers'
``ForCausalLMLoss`` upcasts with ``.float()``, Llama's RMSNorm computes in float32, so a float64
model is not always a float64 computation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.tolerance import epsilon_of

__all__ = ["Uses", "observed_uses"]

#: Functions that read E's rows (the lookup) by their torch entry points.
_LOOKUPS = {F.embedding, torch.embedding, torch.Tensor.__getitem__, torch.index_select,
            torch.Tensor.index_select}
#: h @ W.T for W = E (linear) or h @ X for X = E.T (the matmul family).
_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
           torch.Tensor.mm}
#: Entry points of a backward pass (a training step observed whole runs its backward inside
#: the observed block).
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
#: E.grad read or set (an optimizer's zero_grad, a training step's bookkeeping): not its values.
_GRAD = torch._C.TensorBase.__dict__["grad"]
#: A transpose of a 2-D tensor (the head's E.T).
_TRANSPOSES = {torch.Tensor.t, torch.t, torch.Tensor.T.__get__,  # type: ignore[attr-defined]
               torch.Tensor.mT.__get__,  # type: ignore[attr-defined]
               torch.Tensor.transpose, torch.transpose, torch.Tensor.permute, torch.permute}
#: Functions that take a tensor as a template only (its dtype, device or shape): no use of E.
_TEMPLATES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
              torch.rand_like, torch.randn_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
              torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor}
#: In-place writes of E's values under no_grad: no use (``nn.Embedding(max_norm=...)``'s
#: renormalisation, when a model calls it itself before its lookup).
_WRITES = {torch.embedding_renorm_}
#: Functions that compute the table the uses read from E (the older
#: ``torch.nn.utils.weight_norm`` computes ``W = g * v / |v|`` in a pre-hook): their output is
#: tracked as the table; inside a ``torch.nn.utils.parametrize`` parametrization the same is
#: done by module hooks (see :meth:`_Mode.before_module`).
_DERIVATIONS = {torch._weight_norm}
#: Casts and copies the gradient passes through unchanged (up to rounding).
_CASTS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
          torch.Tensor.double, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.contiguous,
          torch.Tensor.clone}


@dataclass
class Uses:
    """What one observed pass saw at the uses of the tied Parameter."""

    lookups: list[dict[str, Any]] = field(default_factory=list)  # ids, dx slot, options
    heads: list[dict[str, Any]] = field(default_factory=list)  # h, g slot
    unobserved: list[str] = field(default_factory=list)  # uses no reference can vouch for
    least_precise: torch.dtype = torch.float64  # of any floating result of the pass

    def problem(self) -> str | None:
        """Why the recorded uses cannot make the reference, or None."""
        if self.unobserved:
            return "; ".join(dict.fromkeys(self.unobserved))
        if not self.lookups:
            return "no lookup of the tied weight was seen"
        if not self.heads:
            return "no head use of the tied weight was seen"
        missing = [i for i, u in enumerate(self.lookups) if u.get("dx") is None]
        if missing:
            return (f"lookup {missing[0] + 1} of {len(self.lookups)} never received a gradient "
                    "at its output (detached, or unused)")
        if any(u.get("g") is None for u in self.heads):
            return "a head's output never received a gradient"
        return None

    def input_reached(self) -> bool:
        """False when the pass shows that no lookup's gradient reaches the tied weight through
        autograd (every lookup seen, none received a gradient at its output, no use left
        unobserved): the same evidence the first call takes from its untied pass."""
        return bool(self.unobserved) or not self.lookups or \
            any(u.get("dx") is not None for u in self.lookups)


def _name(func: Any) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func)


class _Mode(TorchFunctionMode):
    def __init__(self, E: torch.Tensor, uses: Uses) -> None:
        super().__init__()
        self.E = E
        self.inside_function = 0  # depth of custom autograd.Function forwards running
        self.paused = 0  # inside a backward or an optimizer step: nothing there is a use
        self.pending: list[torch.Tensor] = []  # ids a Function's forward looked up
        # parametrizations of E running (their reads of E make the table, they use nothing)
        self.deriving: list[torch.nn.Module] = []
        # id -> (tensor, orientation): "E" for E or a cast of it, "T" for a transpose.  The
        # tensor is held so that its id is not reused while the pass runs.
        self.tracked: dict[int, tuple[torch.Tensor, str]] = {id(E): (E, "E")}
        self.uses = uses

    def _orientation(self, x: Any) -> str | None:
        entry = self.tracked.get(id(x))
        return None if entry is None or entry[0] is not x else entry[1]

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused or func in _BACKWARD or getattr(func, "__self__", None) is _GRAD:
            # a backward (a training step's, inside the observed block) or an optimizer's
            # update reads E too, and neither is a use of the forward
            self.paused += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.paused -= 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and \
                out.dtype.itemsize < self.uses.least_precise.itemsize:
            self.uses.least_precise = out.dtype
        if self.deriving:
            return out  # computing the table the uses read from E (a parametrization)
        flat = list(args) + list(kwargs.values())
        where = [(i, o) for i, a in enumerate(flat) if (o := self._orientation(a)) is not None]
        if not where and any(isinstance(a, (list, tuple)) and
                             any(self._orientation(b) is not None for b in a) for a in flat):
            where = [(-1, "E")]  # inside a list argument (torch.cat([E, ...])): not a read
        if not where or not isinstance(out, torch.Tensor):
            return out  # E not involved, or a query of its metadata (shape, dtype, ...)
        self._classify(func, args, kwargs, where, out)
        return out

    def _track(self, out: torch.Tensor, orientation: str) -> None:
        self.tracked[id(out)] = (out, orientation)

    def _classify(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  where: list[tuple[int, str]], out: torch.Tensor) -> None:
        slot, orientation = where[0]
        if func in _TEMPLATES or (func in (torch.Tensor.type_as, torch.Tensor.to)
                                  and slot != 0) or func in _WRITES:
            return  # E gave its dtype, device or shape, not its values (or was rescaled)
        if func in _DERIVATIONS and orientation == "E" and slot in (0, 1):
            self._track(out, "E")  # the table itself, computed from E
            return
        if func in _CASTS:
            if slot == 0:
                self._track(out, orientation)
                return
        elif func in _TRANSPOSES and slot == 0 and out.dim() == 2:
            self._track(out, "T" if orientation == "E" else "E")
            return
        elif func in _LOOKUPS and orientation == "E":
            ids, options = self._lookup_ids(func, args, kwargs, slot)
            if ids is not None:
                self._lookup(func, ids, options, out)
                return
        elif func in _LINEAR and slot == 1 and orientation == "E" and len(where) == 1:
            self._head(args[0], out)
            return
        elif func in _MATMUL and slot == 1 and orientation == "T" and len(where) == 1 and \
                not kwargs:
            self._head(args[0], out)
            return
        self.uses.unobserved.append(f"{_name(func)} of the tied weight")

    def _lookup_ids(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    slot: int) -> tuple[torch.Tensor | None, dict[str, Any]]:
        if func is F.embedding and slot == 1:
            names: tuple[str, ...] = ("padding_idx", "max_norm", "norm_type",
                                      "scale_grad_by_freq", "sparse")
            given = dict(zip(names, args[2:])) | kwargs
            # max_norm: torch first rescales the rows read above it, in place and under
            # no_grad, then reads; the gradient is a plain lookup's of the rescaled table, and
            # dx at the output is all the reference takes from it (nothing of E's values)
            return args[0], {"padding_idx": given.get("padding_idx"),
                             "scale_grad_by_freq": bool(given.get("scale_grad_by_freq")),
                             "max_norm": given.get("max_norm")}
        if func is torch.embedding and slot == 0:
            names = ("padding_idx", "scale_grad_by_freq", "sparse")
            given = dict(zip(names, args[2:])) | kwargs
            pad = given.get("padding_idx", -1)
            # torch.embedding spells "no padding" as -1 (F.embedding normalises before it)
            return args[1], {"padding_idx": None if pad == -1 else pad,
                             "scale_grad_by_freq": bool(given.get("scale_grad_by_freq"))}
        if func is torch.Tensor.__getitem__ and slot == 0 and len(args) == 2:
            index = args[1]
            if isinstance(index, torch.Tensor) and not index.is_floating_point() and \
                    index.dtype != torch.bool:
                return index, {}
        if func in (torch.index_select, torch.Tensor.index_select) and slot == 0:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            if dim == 0 and isinstance(index, torch.Tensor):
                return index, {}
        return None, {}

    def _lookup(self, func: Any, ids: torch.Tensor, options: dict[str, Any],
                out: torch.Tensor) -> None:
        if self.inside_function:
            # inside a custom autograd.Function's forward: what it returns decides
            self.pending.append(ids.detach().reshape(-1).long().clone())
            return
        if not out.requires_grad:
            self.uses.unobserved.append(
                f"a lookup ({_name(func)}) whose output takes no gradient (inside an "
                "autograd.Function, under no_grad, or of a detached weight)")
            return
        record: dict[str, Any] = {"ids": _kept(ids.reshape(-1).long()), "dx": None,
                                  **options}
        self.uses.lookups.append(record)
        out.register_hook(  # type: ignore[no-untyped-call]
            lambda g, r=record: _store(r, "dx", g))

    def before_module(self, module: torch.nn.Module, args: Any) -> None:
        """A global forward pre-hook: a ``torch.nn.utils.parametrize`` parametrization of E
        (a ``ParametrizationList`` holding E among its originals) is about to compute the
        table the uses read."""
        from torch.nn.utils.parametrize import ParametrizationList

        if isinstance(module, ParametrizationList) and any(
                self._orientation(p) is not None for p in module.parameters(recurse=False)):
            self.deriving.append(module)

    def after_module(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        """A global forward hook: the table a parametrization of E made is what its uses
        read, so it is tracked as E is (one table per read when nothing caches it)."""
        if self.deriving and self.deriving[-1] is module:
            self.deriving.pop()
            if isinstance(out, torch.Tensor):
                self._track(out, "E")

    def _head(self, h: Any, out: torch.Tensor) -> None:
        if self.inside_function:
            return  # what the custom Function returns decides (see _function_apply)
        if not isinstance(h, torch.Tensor) or not out.requires_grad:
            self.uses.unobserved.append("a head whose output takes no gradient")
            return
        record: dict[str, Any] = {"h": _kept(h.reshape(-1, h.shape[-1])), "g": None}
        self.uses.heads.append(record)
        out.register_hook(  # type: ignore[no-untyped-call]
            lambda g, r=record: _store(r, "g", g))


def _function_apply(mode: _Mode, original: Any) -> Any:
    """``autograd.Function.apply`` for the observed pass.  A custom Function handed E does its
    own forward under no_grad, so its reads of E take no gradient; but what it *returns* is
    observable.  A Function whose forward looked up rows ``ids`` of E and returned exactly
    ``E[ids]`` is a lookup, and one handed ``(h, E)`` that returned ``h @ E.T`` is a head: the
    gradient reaching that output is ``dx`` (or ``g``), whatever its own backward then does
    with it.  Anything else stays a use no reference can vouch for."""
    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if mode.paused or not any(mode._orientation(a) is not None for a in args):
            return original(cls, *args, **kwargs)
        before, pending = len(mode.uses.unobserved), len(mode.pending)
        mode.inside_function += 1
        try:
            out = original(cls, *args, **kwargs)
        finally:
            mode.inside_function -= 1
        looked_up = mode.pending[pending:]
        del mode.pending[pending:]
        if isinstance(out, torch.Tensor) and out.requires_grad and not mode.inside_function:
            # the table it was handed: E, or a parametrization's W computed from it
            W = next((a for a in args if mode._orientation(a) == "E"), mode.E).detach()
            if len(looked_up) == 1 and out.shape[:-1].numel() == looked_up[0].numel() and \
                    out.shape[-1] == W.shape[1] and torch.equal(
                        out.detach().reshape(-1, W.shape[1]), W[looked_up[0]].to(out.dtype)):
                del mode.uses.unobserved[before:]
                mode._lookup(cls.apply, looked_up[0], {}, out)
                return out
            heads = [a for a in args if isinstance(a, torch.Tensor) and
                     mode._orientation(a) is None and a.shape[-1:] == W.shape[1:]]
            if not looked_up and len(heads) == 1 and out.shape[-1] == W.shape[0]:
                # in float64, outside any autocast (which would compute it in bfloat16), and
                # compared at the precision the Function computed in
                with torch.autocast(heads[0].device.type, enabled=False):
                    expect = torch.nn.functional.linear(heads[0].detach().double(),
                                                        W.double())
                scale = float(expect.abs().max()) or 1.0
                rtol = max(1e-5, 8 * epsilon_of(out.dtype))
                if torch.allclose(out.detach().double().reshape(expect.shape), expect,
                                  rtol=rtol, atol=rtol * scale):
                    del mode.uses.unobserved[before:]
                    mode._head(heads[0], out)
                    return out
        if not mode.inside_function:
            mode.uses.unobserved.append(f"a custom autograd.Function ({cls.__name__}) handed "
                                        "the tied weight, returning neither E[ids] nor h @ E.T")
        return out
    return apply


def _bound_apply(original: Any) -> Any:
    """``original(cls, *args)``: the class's own ``Function.apply``, whatever object torch
    keeps it as.  torch 2.13 defines ``apply`` in Python (a ``classmethod`` wrapping a
    function); torch 2.14 keeps the C ``classmethod_descriptor`` of ``_FunctionBase``, which
    has no ``__func__``.  Both bind to a class through the descriptor protocol, the one
    mechanism every release shares; an ``apply`` that does not is a torch this observer was
    never run on, said so with its version instead of a traceback."""
    get = getattr(original, "__get__", None)
    if get is None:
        raise TorchUnsupported(
            f"torch {torch.__version__}: torch.autograd.Function.apply is a "
            f"{type(original).__name__}, not a descriptor, so the uses of the tied weight "
            "inside custom autograd.Functions cannot be observed")
    return lambda cls, *args, **kwargs: get(None, cls)(*args, **kwargs)


class TorchUnsupported(TyingspecError, RuntimeError):
    """This torch lacks a mechanism the observer needs (named in the message)."""


def _store(record: dict[str, Any], key: str, g: torch.Tensor) -> None:
    record[key] = _kept(g.reshape(-1, g.shape[-1]))


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the CPU, where the reference is built (the model may run on a GPU,
    ``--device``)."""
    return t.detach().to("cpu", copy=True)


class observed_uses:  # noqa: N801  (used as a context manager, like torch's modes)
    """``with observed_uses(E) as uses: loss = ...``: the uses of ``E`` in that forward; the
    gradients at them arrive when the loss's backward runs (after the block)."""

    def __init__(self, E: torch.Tensor) -> None:
        self.uses = Uses()
        self._mode = _Mode(E, self.uses)

    def __enter__(self) -> Uses:
        from torch.autograd.function import Function

        self._original = Function.__dict__["apply"]
        Function.apply = classmethod(  # type: ignore[assignment,method-assign]
            _function_apply(self._mode, _bound_apply(self._original)))
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        # parametrizations run as modules (ParametrizationList): seen by global module hooks
        self._hooks = [register_module_forward_pre_hook(self._mode.before_module),
                       register_module_forward_hook(self._mode.after_module)]
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self.uses

    def pause(self) -> None:
        """Stop recording uses until :meth:`resume` (an optimizer's step inside the block)."""
        self._mode.paused += 1

    def resume(self) -> None:
        self._mode.paused -= 1

    def __exit__(self, *exc: Any) -> None:
        from torch.autograd.function import Function

        try:
            self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            Function.apply = self._original  # type: ignore[method-assign]
            for hook in self._hooks:
                hook.remove()
