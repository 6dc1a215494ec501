"""Liger-Kernel's fused linear cross-entropy class, imported without running
``liger_kernel/transformers/__init__.py``: releases before 0.6 import transformers 4's model
code there (``_CONFIG_FOR_DOC``), which transformers 5 no longer has.  The class's own module
is imported as it is; only its package's ``__init__`` is skipped.  The glue a test needs for
an old release, nothing in the kernel changed."""

import pathlib
import sys
import types

import liger_kernel

_PACKAGE = "liger_kernel.transformers"
if _PACKAGE not in sys.modules:
    package = types.ModuleType(_PACKAGE)
    # a namespace package in early releases (no __init__.py, so no __file__)
    package.__path__ = [str(pathlib.Path(list(liger_kernel.__path__)[0]) / "transformers")]
    sys.modules[_PACKAGE] = package

from liger_kernel.transformers.fused_linear_cross_entropy import (  # noqa: E402
    LigerFusedLinearCrossEntropyLoss,
)

__all__ = ["LigerFusedLinearCrossEntropyLoss"]
