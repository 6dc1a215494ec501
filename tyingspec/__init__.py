"""tyingspec: verify tied-embedding gradients row by row — which path, which rows, which bug.

The public surface; everything else lives in underscore modules.  Names load on first use
(PEP 562) so that importing ``tyingspec`` (and its pytest plugin) does not pay for numpy/sympy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._adapters import AdapterError, Returned
    from ._api import assert_correct, check
    from ._builtins import REGISTRY
    from ._cases import Batch, Case, build, standard_cases
    from ._check import CaseResult, CheckFailed, CheckReport, check_target
    from ._diagnosis import LABELS, ArrayCheck, Diagnosis, Label, Power, compare, diagnose
    from ._engine import Observation, Target, call, judge, load, observe, reference
    from ._finite import central_differences
    from ._implementations import Implementation, register
    from ._kinds import KINDS, Kind, KindSpec, resolve
    from ._probe import Paths, closed_form_paths, loss_only
    from ._strategies import cases
    from ._symbolic import symbolic_paths
    from ._tolerance import Precision, Tolerance, tolerance_for
    from ._torch_target import TorchTarget

_WHERE: dict[str, str] = {
    "AdapterError": "._adapters",
    "ArrayCheck": "._diagnosis",
    "Batch": "._cases",
    "Case": "._cases",
    "CaseResult": "._check",
    "CheckReport": "._check",
    "CheckFailed": "._check",
    "check": "._api",
    "assert_correct": "._api",
    "Diagnosis": "._diagnosis",
    "Implementation": "._implementations",
    "LABELS": "._diagnosis",
    "Paths": "._probe",
    "Power": "._diagnosis",
    "REGISTRY": "._builtins",
    "Tolerance": "._tolerance",
    "build": "._cases",
    "cases": "._strategies",
    "Returned": "._adapters",
    "Observation": "._engine",
    "Target": "._engine",
    "call": "._engine",
    "judge": "._engine",
    "load": "._engine",
    "observe": "._engine",
    "reference": "._engine",
    "KINDS": "._kinds",
    "Kind": "._kinds",
    "KindSpec": "._kinds",
    "Label": "._diagnosis",
    "Precision": "._tolerance",
    "central_differences": "._finite",
    "check_target": "._check",
    "closed_form_paths": "._probe",
    "compare": "._diagnosis",
    "diagnose": "._diagnosis",
    "loss_only": "._probe",
    "register": "._implementations",
    "resolve": "._kinds",
    "standard_cases": "._cases",
    "symbolic_paths": "._symbolic",
    "tolerance_for": "._tolerance",
    "TorchTarget": "._torch_target",
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
    "Implementation",
    "Kind",
    "KindSpec",
    "Label",
    "Observation",
    "Paths",
    "Power",
    "Precision",
    "Returned",
    "Target",
    "Tolerance",
    "TorchTarget",
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
