"""The adapter kinds: one line per kind, and nothing else knows how a kind is called.

A line names the module in the kind's folder that defines its :class:`~core.kind.KindSpec`:
what its adapter looks like (its contract and parameter names, used to spot a target of the
wrong kind before the first call), which arrays it is handed for a batch, how it is called and
its outputs validated, which reference it is judged against, whether it is called a second time
after an SGD step, and which properties apply to it.  The engine (:mod:`engine.observe`),
``tyingspec check``, the properties, the pytest plugin and the kill matrix all go through this
table; a kind's module is imported the first time the kind is asked for, so a run of one kind
never loads another.  A new kind is its folder (``kinds/<kind>/spec.py`` and what it needs),
one line here, and its tests.  Nothing in ``front/``, ``engine/`` or ``core/`` compares a
kind's name or imports from its folder (``tests/test_layout.py``): each asks the spec (what it
needs installed, whether it takes ``--padding-idx`` or an ignored target, its peak memory,
...).  A line may end ``needs <module>``: the module every run of the kind imports, read here
without loading the kind (the spec's ``needs`` must agree).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tyingspec._src.core.kind import Implementation, KindSpec, SecondCall

# This module imports nothing but the standard library until a kind is asked for: the pytest
# plugin reads the kinds' names from it in xdist's controller, which never loads numpy.

#: a kind's name, as ``--kind`` spells it (the table's keys are the known ones)
Kind = str

__all__ = ["DEFAULT_KIND", "KINDS", "KIND_NAMES", "OPTIONS_KIND", "Kind", "KindSpec", "SecondCall",
           "builtin_kind", "every_builtin", "fitting", "kind_spec", "needs", "resolve"]

_LINES: dict[str, str] = {
    "model": "tyingspec._src.kinds.probe.spec:MODEL",
    "kernel": "tyingspec._src.kinds.probe.spec:KERNEL",
    "torch": "tyingspec._src.kinds.torch.spec:SPEC  needs torch",
    "linear-ce": "tyingspec._src.kinds.linear_ce.spec:SPEC",
    "jax": "tyingspec._src.kinds.jax.spec:SPEC  needs jax",
    "distributed": "tyingspec._src.kinds.distributed.spec:SPEC  needs torch",
}

#: the kind whose cases carry options (``Case.ce``) and draws them (``KindSpec.draws``):
#: ``tyingspec.build`` builds a case with options with this kind's draws
OPTIONS_KIND: Kind = "linear-ce"

KIND_NAMES: tuple[Kind, ...] = tuple(_LINES)
#: the kind a target runs as when none is given (``tyingspec check TARGET``): the table's first
DEFAULT_KIND: Kind = KIND_NAMES[0]


class _Table(Mapping[str, "KindSpec"]):
    """The kinds by name, in the table's order, each loaded on first use."""

    def __init__(self, lines: Mapping[str, str]) -> None:
        self._lines = dict(lines)
        self._loaded: dict[str, KindSpec] = {}

    def __getitem__(self, name: str) -> KindSpec:
        if name not in self._loaded:
            from tyingspec._src.core.kind import KindSpec

            module, _, attr = self._lines[name].split()[0].partition(":")
            spec = getattr(importlib.import_module(module), attr)
            if not isinstance(spec, KindSpec) or spec.name != name or \
                    spec.needs != _needs_of(self._lines[name]):
                raise TypeError(f"kinds.table: {self._lines[name]} is not the KindSpec of "
                                f"{name!r} (or needs another module than its line says)")
            self._loaded[name] = spec
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)

    def __repr__(self) -> str:
        return f"KINDS({', '.join(self._lines)})"


KINDS: Mapping[Kind, KindSpec] = _Table(_LINES)


def __getattr__(name: str) -> Any:
    # the record types, for ``from kinds.table import KindSpec`` (loaded only when asked for)
    if name in ("KindSpec", "SecondCall"):
        from tyingspec._src.core import kind

        return getattr(kind, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def needs(name: str) -> str | None:
    """The module every run of kind ``name`` imports (its line's ``needs``, the spec's
    ``KindSpec.needs``), read without loading the kind: the pytest plugin requires it in
    xdist's controller, which loads no numpy."""
    return _needs_of(_LINES[name])


def _needs_of(line: str) -> str | None:
    words = line.split()  # "module:attr" or "module:attr  needs <module>"
    return words[2] if len(words) == 3 and words[1] == "needs" else None


def fitting(fn: Callable[..., Any], kind: str) -> tuple[str | None, list[str]]:
    """Why ``fn`` is not a ``kind`` adapter (None when it is), and the other kinds it fits."""
    return KINDS[kind].mismatch(fn), [
        k for k in KINDS if k != kind and KINDS[k].mismatch(fn) is None]


def kind_spec(name: str) -> KindSpec:
    """The table entry of ``name``; ValueError naming the known kinds otherwise."""
    if name not in _LINES:
        raise ValueError(f"unknown kind {name!r}; expected one of {', '.join(KINDS)}")
    return KINDS[name]


def resolve(spec: str, kind: str) -> Callable[..., Any]:
    """Turn a target spec (built-in name or ``module:attr``) into a callable of ``kind``."""
    from tyingspec._src.core.adapters import AdapterError

    if kind not in KINDS:
        raise AdapterError(spec, f"unknown kind {kind!r}", expected=" or ".join(KINDS), got=kind)
    if ":" not in spec:
        known = KINDS[kind].builtins()
        impl = known.get(spec)
        fn = None if impl is None else impl.adapter(kind)
        if spec not in known:
            raise AdapterError(spec, "cannot be resolved",
                               expected="a built-in name (" + ", ".join(sorted(known))
                               + ") or module:attr", got=repr(spec))
        if fn is None:
            raise AdapterError(spec, f"built-in has no {kind} form")
        return fn
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail in any way: report it as the adapter's
        raise AdapterError(spec, f"module {module_name!r} cannot be imported",
                           got=f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AdapterError(spec, f"module {module_name!r} has no attribute {attr!r}"
                               ) from None
        except Exception as exc:  # a module __getattr__ can raise anything
            raise AdapterError(spec, f"looking up {attr!r} in {module_name!r} raised",
                               got=f"{type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise AdapterError(spec, "is not callable", got=type(obj).__name__)
    return obj  # type: ignore[no-any-return]


def every_builtin() -> dict[str, Implementation]:
    """Every kind's built-in targets by name, in the table's order (the probe kinds share one
    zoo, so a name is listed once)."""
    known: dict[str, Implementation] = {}
    for spec in KINDS.values():
        for name, impl in spec.builtins().items():
            known.setdefault(name, impl)
    return known


def builtin_kind(name: str) -> str | None:
    """The first kind (in the table's order) that has a built-in ``name``; None if none."""
    for kind, spec in KINDS.items():
        impl = spec.builtins().get(name)
        if impl is not None and impl.adapter(kind) is not None:
            return kind
    return None
