"""The probe kinds' built-in targets, loaded: the registry (``registry``) filled by the correct
implementations (``implementations``) and the mutant zoo (``mutants``), all three in this folder.

Registering is a side effect of importing those two modules, and both import the registry to
register into; so the one place that imports all three for their contents is this module, above
them, and nothing below it imports it back.
"""

from __future__ import annotations

# importing these two registers their targets
from tyingspec._src.kinds.probe import implementations as _implementations  # noqa: F401
from tyingspec._src.kinds.probe import mutants as _mutants  # noqa: F401
from tyingspec._src.kinds.probe.registry import REGISTRY as REGISTRY
from tyingspec._src.kinds.probe.registry import Implementation


def builtins() -> dict[str, Implementation]:
    """Every built-in target (the correct ones, the broken variants and the mutant zoo)."""
    return REGISTRY


def mutants() -> list[Implementation]:
    """Every broken implementation in the registry (built-in variants and the zoo)."""
    return [impl for impl in REGISTRY.values() if not impl.correct]


def styles() -> list[Implementation]:
    """Every correct implementation in the registry (the built-in and the styles)."""
    return [impl for impl in REGISTRY.values() if impl.correct]
