"""The linear-ce kind's call: a fused linear-cross-entropy kernel, numpy or torch form.

Runs where the user's code runs.  The numpy form is ``f(h, E, targets, b, *, grad_output,
**options) -> {"loss", "dh", "dE", "db"}``; the options it supports are its keyword parameters.
The torch form is a class with Liger's convention, ``cls(**options)(weight, input, target,
bias)`` returning the loss, whose gradients are read through autograd; the options it supports
are its constructor's parameters.  A kernel is only handed the options a case sets, and a case
setting an option it does not support is never run on it (see ``supported``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._adapters import (
    AdapterError,
    Returned,
    _copies,
    _guarded_call,
    _mutated,
    _readable,
    to_numpy,
)
from ._linear_ce_kind import OPTION_NAMES
from ._tolerance import least_precise


def is_torch_form(fn: Any) -> bool:
    """A class, or a factory taking only options (every parameter has a default): Liger's
    ``LigerFusedLinearCrossEntropyLoss(**options)``.  The numpy form takes h, E and targets
    without defaults."""
    if inspect.isclass(fn):
        return True
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def supported(fn: Any) -> list[str]:
    """The options ``fn`` declares: a class's constructor parameters, a function's keywords."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return list(OPTION_NAMES)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return list(OPTION_NAMES)
    return [name for name in OPTION_NAMES if name in params]


def call_linear_ce(spec: str, fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Returned:
    if inputs.get("mode") == "describe":
        return Returned(np.zeros((0, 0)), (), "float64", evidence={
            "form": "torch" if is_torch_form(fn) else "numpy", "options": supported(fn)})
    if is_torch_form(fn):
        return _call_torch(spec, fn, inputs)
    c = _copies(inputs)
    out = _guarded_call(spec, fn, c["h"], c["E"], c["targets"], c["b"],
                        grad_output=c["grad_output"], **c["options"])
    if not isinstance(out, Mapping):
        raise AdapterError(spec, "returned a non-mapping",
                           expected="a mapping with keys loss, dh, dE, db",
                           got=type(out).__name__)
    return _readable(spec, lambda: _returned(spec, inputs, out, _mutated(inputs, c)))


def _returned(spec: str, inputs: Mapping[str, Any], out: Mapping[str, Any],
              mutated: tuple[str, ...]) -> Returned:
    N, d = np.shape(inputs["h"])
    V = np.shape(inputs["E"])[0]
    none = inputs["options"].get("reduction") == "none"
    shapes: dict[str, tuple[int, ...] | None] = {
        "loss": (N,) if none else (), "dh": (N, d), "dE": (V, d),
        "db": None if inputs["b"] is None else (V,)}
    arrays: dict[str, np.ndarray | None] = {}
    for key, shape in shapes.items():
        if key not in out:
            raise AdapterError(spec, "missing key", key=key, expected="keys loss, dh, dE, db",
                               got="keys " + ", ".join(sorted(map(repr, out))))
        if shape is None:
            if out[key] is not None:
                raise AdapterError(spec, "db must be None without a bias", key="db",
                                   expected="None", got=type(out[key]).__name__)
            arrays[key] = None
            continue
        a = to_numpy(out[key])
        if tuple(a.shape) != shape and not (shape == () and a.size == 1):
            raise AdapterError(spec, "wrong shape", key=key, expected=str(shape),
                               got=str(tuple(a.shape)))
        if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
            raise AdapterError(spec, "not a float array", key=key,
                               expected="float64, float32, float16 or bfloat16",
                               got=str(a.dtype))
        arrays[key] = a.reshape(shape)
    # inf/NaN is a verdict here (a kernel that overflows), not a malformed result
    nonfinite = [k for k, a in arrays.items() if a is not None and not np.all(np.isfinite(a))]
    dE = arrays["dE"]
    assert dE is not None
    precision = least_precise(*[a.dtype for a in arrays.values() if a is not None])
    loss = arrays["loss"]
    return Returned(dE, mutated, precision, loss=None, db=arrays["db"],
                    evidence={"dh": arrays["dh"], "loss": loss, "nonfinite": nonfinite})


def _call_torch(spec: str, cls: Any, inputs: Mapping[str, Any]) -> Returned:
    import torch

    def tensor(a: Any) -> Any:
        a = np.array(a)  # a copy: the kernel may write into its inputs
        if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 has torch's bit layout
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    opts = dict(inputs["options"])
    if "ce_weight" in opts:
        opts["ce_weight"] = tensor(opts["ce_weight"])
    loss_fn = _guarded_call(spec, cls, **opts)
    h = tensor(inputs["h"]).requires_grad_(True)
    E = tensor(inputs["E"]).requires_grad_(True)
    y = tensor(inputs["targets"])
    b = None if inputs["b"] is None else tensor(inputs["b"]).requires_grad_(True)
    loss = _guarded_call(spec, loss_fn, E, h, y, b)
    if not isinstance(loss, torch.Tensor):
        raise AdapterError(spec, "the loss is not a tensor", expected="a torch.Tensor",
                           got=type(loss).__name__)
    go = inputs["grad_output"]

    def backward() -> None:
        if go is not None and loss.dim() == 1:
            loss.backward(tensor(go).to(loss.dtype))  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    _guarded_call(spec, backward)

    def grad(t: Any, shape: tuple[int, ...]) -> Any:
        return t.grad if t.grad is not None else torch.zeros(shape, dtype=t.dtype)

    out = {"loss": loss.detach(), "dh": grad(h, tuple(h.shape)), "dE": grad(E, tuple(E.shape)),
           "db": None if b is None else grad(b, tuple(b.shape))}
    return _readable(spec, lambda: _returned(spec, inputs, out, ()))
