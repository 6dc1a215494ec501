"""A tied table that its uses read as a computed tensor: a parametrization's weight.

Under ``torch.nn.utils.parametrize`` (``register_parametrization``, and the parametrizations
built on it: ``torch.nn.utils.parametrizations.weight_norm``, ``orthogonal``,
``spectral_norm``) a module's ``weight`` is no Parameter: every read computes ``W =
P(original)`` from the Parameter(s) ``P`` keeps (``module.parametrizations.weight.original``,
or ``original0``, ``original1``, ...).  The older ``torch.nn.utils.weight_norm`` computes ``W``
from ``weight_g`` and ``weight_v`` in a forward pre-hook and leaves it on the module as a plain
tensor.  A tied model then ties the *table*: the lookup and a head that reads ``wte.weight``
(``F.linear(h, self.wte.weight)``, torchtune's ``TiedLinear``), or two modules parametrized
over one Parameter, consume ``W``.

What is judged for such a tie is the gradient arriving at the table, ``dL/dW`` summed over
every ``W`` the uses consumed (one per read when nothing caches it), before the
parametrization's own backward carries it to the originals: that is what the two uses'
backward produce, and the reference (``dx``, ``h``, ``g`` at the uses of ``W``) is its sum by
construction.  The originals are still what the optimizer holds, so the identity and
optimizer checks look at them.

Everything here runs in the worker, on models the check built; a model without such a table
is left untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList, is_parametrized
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["Table", "frozen_table", "install", "lookup_tables", "renormalised_rows",
           "renormalising", "table_module", "table_parameters", "table_shape", "tables",
           "tables_of", "tied_grad", "tied_grad_of", "unchanged_tables"]

#: Set on a module once its capture hook is registered (a deep copy carries both along).
_HOOKED = "_tyingspec_hooked"
#: On the Parameter a table is named by: dL/dW accumulated since its gradient was last cleared,
#: and whether a backward pass is adding to it.
_DW, _LIVE = "_tyingspec_dW", "_tyingspec_live"
#: On a table's producer: the tensor it hands out instead of computing W (the forward check).
_FROZEN = "_tyingspec_frozen"


@dataclass(frozen=True)
class Table:
    """One computed table: ``name`` is what its module's forward reads (``wte.weight``)."""

    name: str
    module: str  # the module holding it ("wte"; "" for the model itself)
    attribute: str  # "weight"
    originals: tuple[str, ...]  # the Parameters W is computed from, as named_parameters names
    how: str  # the mechanism, for the report

    @property
    def key(self) -> str:
        """The original the check names the tie by: the largest (weight norm's ``v``, ``[V,
        d]``, not its ``g``, ``[V, 1]``), the first among equals."""
        return self.originals[0]


def _prefix(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _tables(model: nn.Module) -> Iterator[tuple[Table, nn.Module]]:
    """Every computed table in ``model`` and its producer (the ``ParametrizationList``, or the
    module whose ``WeightNorm`` pre-hook computes it)."""
    for path, module in model.named_modules():
        if is_parametrized(module):
            for attribute, plist in module.parametrizations.items():
                mine = _prefix(path, f"parametrizations.{attribute}")
                originals = sorted(((-p.numel(), i, _prefix(mine, n)) for i, (n, p) in
                                    enumerate(plist.named_parameters(recurse=False))))
                if originals:
                    steps = ", ".join(type(m).__name__ for m in plist)
                    yield Table(_prefix(path, attribute), path, attribute,
                                tuple(n for _, _, n in originals),
                                f"torch.nn.utils.parametrize ({steps})"), plist
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                v, g = _prefix(path, hook.name + "_v"), _prefix(path, hook.name + "_g")
                yield Table(_prefix(path, hook.name), path, hook.name, (v, g),
                            "torch.nn.utils.weight_norm"), module


def tables(model: nn.Module) -> list[Table]:
    """Every computed table in ``model``."""
    return [t for t, _ in _tables(model)]


def tables_of(model: nn.Module, name: str) -> list[Table]:
    """The computed tables the Parameter ``name`` is an original of (two when two modules are
    parametrized over one Parameter); empty for a Parameter the uses read as it is."""
    p = _param(model, name)
    return [] if p is None else [t for t, _ in _made_from(model, p)]


def _made_from(model: nn.Module, p: torch.Tensor) -> list[tuple[Table, nn.Module]]:
    """The computed tables ``p`` is an original of, with their producers."""
    return [(t, producer) for t, producer in _tables(model)
            if any(_param(model, o) is p for o in t.originals)]


def _param(model: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def table_parameters(model: nn.Module, name: str) -> list[str]:
    """The Parameters an optimizer steps for the tie named ``name``: the tied Parameter
    itself, or every original of the tables computed from it."""
    out: dict[int, str] = {id(model.get_parameter(name)): name}
    for table in tables_of(model, name):
        for original in table.originals:
            # one Parameter two modules are parametrized over is one Parameter to step
            out.setdefault(id(model.get_parameter(original)), original)
    return list(out.values())


def lookup_tables(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every ``nn.Embedding``'s table as a tie is named and observed by: its Parameter, or,
    for a computed one, the original it is named by (see :attr:`Table.key`)."""
    keyed = {(t.module, t.attribute): t for t, _ in _tables(model)}
    out: list[tuple[str, torch.Tensor]] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Embedding):
            continue
        table = keyed.get((path, "weight"))
        if table is not None:
            out.append((table.key, model.get_parameter(table.key)))
        elif isinstance(getattr(module, "weight", None), nn.Parameter):
            out.append((_prefix(path, "weight"), module.weight))
    return out


def table_module(model: nn.Module, name: str) -> nn.Module:
    """The module that reads the tie named ``name`` as its own weight: the module holding the
    Parameter, or the module a table computed from it belongs to (a lookup's first: its
    ``padding_idx``, ``max_norm`` and ``scale_grad_by_freq`` are the tie's)."""
    found = [model.get_submodule(t.module) if t.module else model
             for t in tables_of(model, name)]
    lookups = [m for m in found if isinstance(m, nn.Embedding)]
    if lookups or found:
        return (lookups or found)[0]
    prefix = name.rpartition(".")[0]
    return model.get_submodule(prefix) if prefix else model


def _read(model: nn.Module, table: Table) -> torch.Tensor:
    module = model.get_submodule(table.module) if table.module else model
    out: torch.Tensor = getattr(module, table.attribute)
    return out


def table_shape(model: nn.Module, name: str) -> tuple[int, ...]:
    """The shape of the table the uses read for the tie named ``name``."""
    for table in tables_of(model, name):
        with torch.no_grad():
            return tuple(_read(model, table).shape)
    return tuple(model.get_parameter(name).shape)


# --- dL/dW: captured where W is made -------------------------------------------------------

def install(model: nn.Module) -> None:
    """Register, on every producer of a table a lookup reads (and of the tables computed from
    the same Parameters: a head parametrized over the lookup's Parameter), the hook that sums
    ``dL/dW`` over the tensors it makes (see :func:`tied_grad`).  Idempotent; a model without
    such a table gets no hook."""
    found = list(_tables(model))
    looked_up = {id(_param(model, o)) for t, _ in found if t.module and isinstance(
        model.get_submodule(t.module), nn.Embedding) for o in t.originals}
    for table, producer in found:
        if not looked_up & {id(_param(model, o)) for o in table.originals} or \
                getattr(producer, _HOOKED, False):
            continue
        if isinstance(producer, ParametrizationList):
            producer.register_forward_hook(_made_by_parametrization)
        else:  # registered after WeightNorm's own pre-hook, so it runs after it
            producer.register_forward_pre_hook(_made_by_weight_norm)
        setattr(producer, _HOOKED, True)


def _made_by_parametrization(plist: nn.Module, args: Any, out: Any) -> Any:
    frozen = getattr(plist, _FROZEN, None)
    if frozen is not None:
        return frozen
    originals = list(plist.parameters(recurse=False))
    if originals and isinstance(out, torch.Tensor):
        _capture(out, max(originals, key=lambda p: p.numel()), originals)
    return None


def _made_by_weight_norm(module: nn.Module, args: Any) -> None:
    for hook in module._forward_pre_hooks.values():
        if not isinstance(hook, WeightNorm):
            continue
        frozen = getattr(module, _FROZEN, None)
        if frozen is not None:
            setattr(module, hook.name, frozen)
            continue
        g, v = getattr(module, hook.name + "_g"), getattr(module, hook.name + "_v")
        _capture(getattr(module, hook.name), v, [v, g])


def _capture(W: torch.Tensor, key: nn.Parameter, originals: list[nn.Parameter]) -> None:
    if W.requires_grad:
        W.register_hook(lambda g: _arrived(key, originals, g))  # type: ignore[no-untyped-call]


def _arrived(key: nn.Parameter, originals: list[nn.Parameter], g: torch.Tensor) -> None:
    """Add one W's gradient to the sum kept on ``key``.  The sum follows the originals'
    ``.grad``: the first W of a backward pass starts it afresh when they were cleared
    (``zero_grad()``: None, or zeros), and adds to it otherwise (micro-batches accumulate).
    The originals' own ``.grad`` is only written after every W of the pass has arrived
    (autograd sums a leaf's inputs first), so it still says what it said before the pass."""
    if not getattr(key, _LIVE, False):
        from torch.autograd import Variable

        setattr(key, _LIVE, True)
        Variable._execution_engine.queue_callback(lambda: setattr(key, _LIVE, False))
        if all(o.grad is None or not bool(o.grad.any()) for o in originals):
            setattr(key, _DW, None)
    total = getattr(key, _DW, None)
    setattr(key, _DW, g.detach().clone() if total is None else total + g.detach())


def tied_grad(model: nn.Module, name: str) -> torch.Tensor | None:
    """The model's own tied gradient for the tie named ``name``: the Parameter's ``.grad``,
    or, for a computed table, ``dL/dW`` summed over the tensors its producers made since the
    originals' gradient was last cleared (None when it is cleared)."""
    return tied_grad_of(model, model.get_parameter(name))


def tied_grad_of(model: nn.Module, p: torch.Tensor) -> torch.Tensor | None:
    """:func:`tied_grad` for the tied Parameter ``p`` itself."""
    made = _made_from(model, p)
    if not any(getattr(producer, _HOOKED, False) for _, producer in made):
        return p.grad
    originals = [q for t, _ in made for q in (_param(model, o) for o in t.originals)]
    if all(q is None or q.grad is None for q in originals):
        return None
    out: torch.Tensor | None = getattr(p, _DW, None)
    return out


def frozen_table(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor to perturb in place for the forward check: the tied Parameter, or, for a
    computed table, a copy of ``W`` that the table's producers hand out from now on instead
    of computing it (a perturbation of the originals would difference ``L(P(original))``,
    not ``L(W)``).  The model keeps that table for the rest of its life: call this on a
    model built for the forward check alone."""
    p = model.get_parameter(name)
    made = _made_from(model, p)
    if not made:
        return p
    with torch.no_grad():
        W = _read(model, made[0][0]).detach().clone()
    for _, producer in made:
        setattr(producer, _FROZEN, W)
    return W


# --- nn.Embedding(max_norm=...) --------------------------------------------------------------

#: A row read by a ``max_norm`` lookup whose norm is within this fraction of ``max_norm`` sits
#: at the renormalisation (torch scales a row above it to ``max_norm / (norm + 1e-7)``).
_AT_MAX_NORM = 1e-3


@contextmanager
def unchanged_tables(model: nn.Module) -> Iterator[None]:
    """Run a block (discovery's probe forwards) and leave every ``max_norm`` lookup's table as
    it found it: such a forward rescales the rows it reads in place, so a probe would change
    the model the check then judges (rows the batch never reads, rescaled on one model and
    not on the next one built)."""
    kept = [(m.weight, m.weight.detach().clone()) for m in model.modules()
            if isinstance(m, nn.Embedding) and m.max_norm is not None and
            isinstance(m.weight, nn.Parameter)]
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, values in kept:
                weight.copy_(values)


def renormalising(model: nn.Module, name: str) -> str | None:
    """Why micro-batches of a ``max_norm`` lookup rightly differ from one batch (None for any
    other): each micro-batch's forward rescales only the rows it reads, so an earlier one's
    head scores with rows a later one has yet to rescale, where one batch rescales them all
    first."""
    module = table_module(model, name)
    max_norm = getattr(module, "max_norm", None)
    if not isinstance(module, nn.Embedding) or max_norm is None:
        return None
    return (f"nn.Embedding(max_norm={max_norm}) rescales the rows each forward reads, in "
            "place, so a micro-batch's head scores with rows a later micro-batch has yet to "
            "rescale, and micro-batches rightly differ from one batch")


def renormalised_rows(model: nn.Module, name: str, reads: np.ndarray) -> np.ndarray:
    """The rows a ``max_norm`` lookup reads that sit at its renormalisation, where the forward
    check's difference quotient is not the model's gradient: torch's forward rescales a read
    row above ``max_norm`` in place, under no_grad, and its gradient is that of a plain lookup
    of the rescaled table (declared semantics, as ``padding_idx`` is).  Rows no lookup reads,
    and read rows inside the norm ball, are differenced as any other."""
    module = table_module(model, name)
    max_norm = getattr(module, "max_norm", None)
    if not isinstance(module, nn.Embedding) or max_norm is None:
        return np.zeros(0, dtype=np.int64)
    read = np.unique(np.asarray(reads, dtype=np.int64))
    tables = tables_of(model, name)
    with torch.no_grad():
        W = _read(model, tables[0]) if tables else model.get_parameter(name)
        norms = torch.linalg.vector_norm(W.detach().double()[torch.from_numpy(read)],
                                         ord=float(module.norm_type), dim=1).cpu().numpy()
    at: np.ndarray = read[norms >= float(max_norm) * (1 - _AT_MAX_NORM)]
    return at
