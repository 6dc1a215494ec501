"""Unsloth's cross-entropy kernel (``unsloth_ce``) from a release that needs a GPU to import:
before its CPU fallback (2026.10), ``import unsloth`` and ``import unsloth_zoo`` raise "Unsloth
cannot find any torch accelerator? You need a GPU.", and ``unsloth_zoo``'s package also checks
that ``unsloth`` imported it first.  So the two packages' ``__init__`` are skipped (their
modules imported as they are, like ``liger_direct``), ``unsloth_zoo``'s device constants set
as its ``__init__`` would on a CUDA machine, and ``UNSLOTH_ALLOW_CPU=1`` set: Unsloth's own
switch for its tests without a GPU, under which ``unsloth.device_type`` answers "cuda".  The
glue a test needs for an old release, nothing in the kernel changed."""

import importlib.machinery
import importlib.util
import os
import pathlib
import sys
import types

os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")


def _package(name: str, where: pathlib.Path) -> types.ModuleType:
    """``name`` as a package of ``where`` whose ``__init__`` is not run."""
    module = types.ModuleType(name)
    module.__path__ = [str(where)]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = module.__path__
    sys.modules[name] = module
    return module


def _root(name: str) -> pathlib.Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return pathlib.Path(list(spec.submodule_search_locations)[0])


if "unsloth" not in sys.modules:
    unsloth = _root("unsloth")
    zoo = _package("unsloth_zoo", _root("unsloth_zoo"))
    zoo.DEVICE_TYPE = zoo.DEVICE_TYPE_TORCH = "cuda"  # type: ignore[attr-defined]
    zoo.DEVICE_COUNT = 0  # type: ignore[attr-defined]
    _package("unsloth", unsloth)
    _package("unsloth.kernels", unsloth / "kernels")

from unsloth_ce import UnslothCrossEntropy  # noqa: E402

__all__ = ["UnslothCrossEntropy"]
