"""tyingspec: verify tied-embedding gradients row by row — which path, which rows, which bug.

The public surface; everything else lives in underscore modules.  Names load on first use
(PEP 562) so that importing ``tyingspec`` (and its pytest plugin) does not pay for numpy/sympy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The release (CHANGELOG.md); pyproject.toml reads it from here, and the Action's tag in
#: examples/ci/tied-gradients.yml is ``v`` and this.
__version__ = "0.2.0"

if TYPE_CHECKING:
    from tyingspec._src.core.adapters import AdapterError, Returned
    from tyingspec._src.core.cases import Batch, Case, standard_cases
    from tyingspec._src.core.diagnosis import (
        LABELS,
        ArrayCheck,
        Diagnosis,
        Label,
        Power,
        compare,
        diagnose,
    )
    from tyingspec._src.core.errors import TyingspecError
    from tyingspec._src.core.finite import central_differences
    from tyingspec._src.core.kind import Implementation, KindSpec
    from tyingspec._src.core.paths import Paths, closed_form_paths, loss_only
    from tyingspec._src.core.strategies import cases
    from tyingspec._src.core.symbolic import symbolic_paths
    from tyingspec._src.core.tolerance import Precision, Tolerance, tolerance_for
    from tyingspec._src.engine.observe import (
        Observation,
        Target,
        call,
        judge,
        load,
        observe,
        reference,
    )
    from tyingspec._src.front.api import assert_correct, check
    from tyingspec._src.front.batches import build
    from tyingspec._src.front.check import check_target
    from tyingspec._src.front.results import CaseResult, CheckFailed, CheckReport, NoPower
    from tyingspec._src.kinds.distributed.target import DistributedTarget
    from tyingspec._src.kinds.jax.target import JaxTarget
    from tyingspec._src.kinds.probe.builtins import REGISTRY
    from tyingspec._src.kinds.probe.implementations import register
    from tyingspec._src.kinds.table import KINDS, Kind, resolve
    from tyingspec._src.kinds.torch.target import StepBatch, TorchTarget

_WHERE: dict[str, str] = {
    "AdapterError": "._src.core.adapters",
    "TyingspecError": "._src.core.errors",
    "ArrayCheck": "._src.core.diagnosis",
    "Batch": "._src.core.cases",
    "Case": "._src.core.cases",
    "CaseResult": "._src.front.results",
    "CheckReport": "._src.front.results",
    "CheckFailed": "._src.front.results",
    "NoPower": "._src.front.results",
    "check": "._src.front.api",
    "assert_correct": "._src.front.api",
    "Diagnosis": "._src.core.diagnosis",
    "Implementation": "._src.core.kind",
    "JaxTarget": "._src.kinds.jax.target",
    "LABELS": "._src.core.diagnosis",
    "Paths": "._src.core.paths",
    "Power": "._src.core.diagnosis",
    "REGISTRY": "._src.kinds.probe.builtins",
    "Tolerance": "._src.core.tolerance",
    "build": "._src.front.batches",
    "cases": "._src.core.strategies",
    "Returned": "._src.core.adapters",
    "Observation": "._src.engine.observe",
    "Target": "._src.engine.observe",
    "call": "._src.engine.observe",
    "judge": "._src.engine.observe",
    "load": "._src.engine.observe",
    "observe": "._src.engine.observe",
    "reference": "._src.engine.observe",
    "KINDS": "._src.kinds.table",
    "Kind": "._src.kinds.table",
    "KindSpec": "._src.core.kind",
    "Label": "._src.core.diagnosis",
    "Precision": "._src.core.tolerance",
    "central_differences": "._src.core.finite",
    "check_target": "._src.front.check",
    "closed_form_paths": "._src.core.paths",
    "compare": "._src.core.diagnosis",
    "diagnose": "._src.core.diagnosis",
    "loss_only": "._src.core.paths",
    "register": "._src.kinds.probe.implementations",
    "resolve": "._src.kinds.table",
    "standard_cases": "._src.core.cases",
    "symbolic_paths": "._src.core.symbolic",
    "tolerance_for": "._src.core.tolerance",
    "TorchTarget": "._src.kinds.torch.target",
    "StepBatch": "._src.kinds.torch.target",
    "DistributedTarget": "._src.kinds.distributed.target",
}

__all__ = [
    "KINDS",
    "LABELS",
    "REGISTRY",
    "AdapterError",
    "ArrayCheck",
    "Batch",
    "Case",
    "CaseResult",
    "CheckFailed",
    "CheckReport",
    "Diagnosis",
    "DistributedTarget",
    "Implementation",
    "JaxTarget",
    "Kind",
    "KindSpec",
    "Label",
    "NoPower",
    "Observation",
    "Paths",
    "Power",
    "Precision",
    "Returned",
    "StepBatch",
    "Target",
    "Tolerance",
    "TorchTarget",
    "TyingspecError",
    "assert_correct",
    "build",
    "call",
    "check",
    "cases",
    "central_differences",
    "check_target",
    "closed_form_paths",
    "compare",
    "diagnose",
    "judge",
    "load",
    "loss_only",
    "observe",
    "reference",
    "register",
    "resolve",
    "standard_cases",
    "symbolic_paths",
    "tolerance_for",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tyingspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
