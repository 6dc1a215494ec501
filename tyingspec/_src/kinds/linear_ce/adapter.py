"""The linear-ce kind's call: a fused linear-cross-entropy kernel, numpy or torch form.

Runs where the user's code runs.  The numpy form is ``f(h, E, targets[, b], *[, grad_output],
**options) -> {"loss", "dh", "dE", "db"}``; the options it supports are its keyword parameters.
The torch form is a class with Liger's convention, ``cls(**options)(weight, input, target[,
bias])`` returning the loss, whose gradients are read through autograd; the options it supports
are its constructor's parameters.  A kernel is only handed the options a case sets, and a case
setting an option it does not support is never run on it (see ``supported``).

Most real kernels take no bias (cut-cross-entropy, torchtune, litgpt) and no ``grad_output``
(only a kernel with ``reduction="none"`` needs one): what a kernel accepts is read from its
signature, and it is called with only that.  ``bias`` and ``grad_output`` are listed among the
capabilities ``supported`` reports, so that the cases needing them are left out (and said to
be) rather than run into a TypeError.  A ``reduction`` annotated ``Literal["mean", "sum"]``
declares those values only (``reduction=mean`` and ``reduction=sum``).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tyingspec._src.core.adapters import (
    AdapterError,
    Handed,
    Returned,
    _guarded_call,
    _readable,
    to_numpy,
)
from tyingspec._src.core.tolerance import least_precise
from tyingspec._src.kinds.linear_ce import interpreter
from tyingspec._src.kinds.linear_ce.kind import (
    IGNORE_INDEX,
    LOW_PRECISIONS,
    OPTION_NAMES,
    REDUCTION_VALUES,
)


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


def _positional(params: Mapping[str, inspect.Parameter]) -> tuple[int, bool]:
    """How many parameters take a positional argument, and whether ``*args`` is among them."""
    kinds = [p.kind for p in params.values()]
    return (sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                for k in kinds), inspect.Parameter.VAR_POSITIONAL in kinds)


def _forward_params(fn: Any) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of a torch-form class's ``forward`` (without ``self``); None when they
    cannot be read without building the module (a factory function, a C type)."""
    forward = getattr(fn, "forward", None) if inspect.isclass(fn) else None
    if forward is None:
        return None
    try:
        params = dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    params.pop(next(iter(params), ""), None)  # self
    return params


def signature_problem(fn: Any) -> str | None:
    """Why ``fn`` is not a linear-ce kernel of either form; None when it is (or when its
    signature cannot be read).  The torch form's constructor takes options only (any number
    of them, none required) and its ``forward`` takes (weight, input, target[, bias]); the
    numpy form takes (h, E, targets[, b]) positionally."""
    if is_torch_form(fn):
        if inspect.isclass(fn):
            try:
                init = inspect.signature(fn)
            except (TypeError, ValueError):
                init = None
            required = [] if init is None else [
                n for n, p in init.parameters.items() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if required:
                return (f"the constructor requires {', '.join(required)}; a linear-ce class "
                        "is built from options alone (every parameter with a default)")
        params = _forward_params(fn)
        if params is None:
            return None
        count, star = _positional(params)
        if count < 3 and not star:
            return (f"forward{inspect.signature(fn.forward)} takes {count} positional "
                    "argument(s); a linear-ce class is called as (weight, input, target[, bias])")
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    count, star = _positional(params)
    if count < 3 and not star:
        name = getattr(fn, "__name__", "f")
        return (f"{name}{inspect.signature(fn)} takes {count} positional argument(s); a "
                "linear-ce function is called as f(h, E, targets[, b], *, **options)")
    return None


def _takes_bias(fn: Any) -> bool:
    """Whether the kernel takes a bias: a 4th positional parameter (or ``*args``), of
    ``forward`` for a class.  A factory's module is not built to find out: assumed."""
    if is_torch_form(fn):
        params = _forward_params(fn)
        if params is None:
            return True
    else:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return True
    count, star = _positional(params)
    return star or count >= 4


def _reduction_values(param: inspect.Parameter) -> tuple[str, ...]:
    """The reductions a ``reduction`` parameter declares: a ``Literal[...]`` annotation's
    values (a string annotation too, as ``from __future__ import annotations`` leaves it),
    else all three."""
    ann = param.annotation
    if isinstance(ann, str) or hasattr(ann, "__args__"):
        text = ann if isinstance(ann, str) else repr(ann)
        if "Literal" in text:
            found = tuple(v for v in REDUCTION_VALUES
                          if re.search(rf"""['"]{v}['"]""", text))
            if found:
                return found
    return REDUCTION_VALUES


def supported(fn: Any) -> list[str]:
    """What ``fn`` declares: the options among a class's constructor parameters or a
    function's keywords, ``reduction=<value>`` for each reduction it takes, ``bias`` when it
    takes a bias, ``grad_output`` when it can be given one (a torch class always: autograd),
    and the low precisions a torch class is run in."""
    torch_form = is_torch_form(fn)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        names = list(OPTION_NAMES)
        reductions = REDUCTION_VALUES
    else:
        names = [name for name in OPTION_NAMES if name in params]
        reductions = _reduction_values(params["reduction"]) if "reduction" in params else ()
    if torch_form:
        # a constructor is cheap to call: what it refuses (a TypeError from **kwargs passed
        # on to nn.CrossEntropyLoss, an assert on reduction) it does not support
        names = [n for n in names if n == "reduction" or _constructs(fn, n, _PROBES[n])]
        reductions = tuple(v for v in reductions if _constructs(fn, "reduction", v))
        if not reductions and "reduction" in names:
            names.remove("reduction")
    out = names + [f"reduction={v}" for v in reductions]
    if _takes_bias(fn):
        out.append("bias")
    if torch_form or params is None or "grad_output" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values()):
        out.append("grad_output")
    if torch_form:
        out += list(LOW_PRECISIONS) + ["device=cuda"]
    return out


def _call(spec: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``_guarded_call``, an exception that is a gap of the Triton interpreter named as one
    (the triton version, the construct, the kernel's line): an adapter error, exit 2."""
    try:
        return _guarded_call(spec, fn, *args, **kwargs)
    except AdapterError as exc:
        cause = exc.__cause__
        why = None if cause is None else interpreter.gap(cause)
        if why is None:
            raise
        raise AdapterError(spec, "cannot run its Triton kernel here", got=why) from cause


#: A value of each option a torch-form constructor is tried with (the standard cases' own).
_PROBES: dict[str, Any] = {"logit_scale": 0.0625, "softcap": 2.0, "label_smoothing": 0.1,
                           "lse_square_scale": 0.01, "ignore_index": -100, "ce_weight": "ones"}


def _constructs(cls: Any, name: str, value: Any) -> bool:
    """Whether the torch-form ``cls`` can be built with ``name=value`` alone."""
    if value == "ones":
        import torch

        value = torch.ones(8)
    try:
        cls(**{name: value})
    except Exception:  # noqa: BLE001  (any refusal: the option, or this value, is not its)
        return False
    return True


#: The batch a Triton kernel's block sizes are read from under the interpreter: the long
#: case's V and d (a lane block follows V), a few tokens.
_PROBE_SHAPE = (11, 4, 23)


def _blocks_seen(spec: str, fn: Callable[..., Any]) -> int:
    """The largest block size the kernel's Triton launches use at the long case's V and d,
    read from one call on a small batch under the interpreter (0: none seen, or it raised:
    the cases then say what is wrong)."""
    V, d, N = _PROBE_SHAPE
    rng = np.random.default_rng(0)
    inputs: dict[str, Any] = {"h": rng.normal(size=(N, d)), "E": rng.normal(size=(V, d)) * 0.5,
              "targets": rng.integers(V, size=N), "b": None, "options": {},
              "grad_output": None}
    with contextlib.suppress(Exception):  # a probe: the cases report the kernel's errors
        call_linear_ce(spec, fn, inputs)
    return interpreter.largest_block()


def call_linear_ce(spec: str, fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Returned:
    interpreter.install()  # once, and only when the target's import brought triton in
    if inputs.get("mode") == "describe":
        declared = getattr(fn, "tyingspec_block", None)
        # interpreted: a Triton kernel of its own ran under the interpreter on the probe batch
        # (triton loaded and the interpreter on say nothing of a numpy or plain torch kernel)
        seen = _blocks_seen(spec, fn) if interpreter.interpreting() else 0
        version = interpreter.interpreting() if interpreter.LAUNCHED else None
        return Returned(np.zeros((0, 0)), (), "float64", evidence={
            "form": "torch" if is_torch_form(fn) else "numpy", "options": supported(fn),
            "interpreted": version, "filled": list(interpreter.FILLED),
            "block_declared": None if declared is None else int(declared),
            "block_seen": seen if version and declared is None else None})
    try:
        if is_torch_form(fn):
            return _call_torch(spec, fn, inputs)
        return _call_numpy(spec, fn, inputs)
    except AdapterError as exc:
        if exc.problem != "raised an exception" or not _every_target_ignored(inputs):
            raise
        # a kernel defect, not a slip of the glue: say so on the case, with the kernel's own
        # exception (the case's status stays an adapter error: no gradient came back to judge)
        raise AdapterError(spec, "the kernel raised on a batch whose every target is ignored "
                           "(torch's cross_entropy returns NaN for a mean over no token, 0 for "
                           "a sum, and zero gradients; a kernel should not raise there)",
                           got=exc.got) from exc.__cause__


def _every_target_ignored(inputs: Mapping[str, Any]) -> bool:
    """Whether the call's batch has no live target (every one the ignore_index)."""
    ignore = inputs.get("options", {}).get("ignore_index", IGNORE_INDEX)
    targets = np.asarray(inputs.get("targets", ()))
    return targets.size > 0 and bool(np.all(targets == ignore))


def _call_numpy(spec: str, fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Returned:
    takes = supported(fn)
    for name, key in (("bias", "b"), ("grad_output", "grad_output")):
        if inputs[key] is not None and name not in takes:  # the cases needing it are left out
            raise AdapterError(spec, f"takes no {name}, and this case has one",
                               expected=f"a kernel declaring {name} for this case",
                               got=_signature(fn))
    with Handed(inputs) as c:
        args = (c["h"], c["E"], c["targets"]) + (() if c["b"] is None else (c["b"],))
        # grad_output only where the kernel declares it: one without it takes mean and sum
        extra = {"grad_output": c["grad_output"]} if "grad_output" in takes else {}
        out = _call(spec, fn, *args, **extra, **c["options"])
        mutated = c.mutated(out)
        out = c.unaliased(out)
    if not isinstance(out, Mapping):
        raise AdapterError(spec, "returned a non-mapping",
                           expected="a mapping with keys loss, dh, dE, db",
                           got=type(out).__name__)
    return _readable(spec, lambda: _returned(spec, inputs, out, mutated))


def _signature(fn: Any) -> str:
    try:
        return f"{getattr(fn, '__name__', 'f')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


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
        if key == "loss" and none and a.size == 1 and N != 1:
            # one number for reduction="none" (Liger #488: the sum): a wrong forward, named by
            # the judgement with the shapes, not a malformed result
            shape = ()
        if tuple(a.shape) != shape and not (shape == () and a.size == 1):
            raise AdapterError(spec, "wrong shape", key=key, expected=str(shape),
                               got=str(tuple(a.shape)))
        if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
            raise AdapterError(spec, "not a float array", key=key,
                               expected="float64, float32, float16 or bfloat16",
                               got=str(a.dtype))
        # not reshaped when it has the shape: a view would hide that nothing else holds dE
        # (kind._tied_total adds into it then, not into a copy)
        arrays[key] = a if a.shape == shape else a.reshape(shape)
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
        # shares ``a``: every array given here is the call's own (a Handed copy, or spilled)
        a = np.asarray(a)
        if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 has torch's bit layout
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    device = inputs.get("device", "cpu")
    if device != "cpu" and not torch.cuda.is_available():
        raise AdapterError(spec, f"--device {device}: torch sees no CUDA device here",
                           expected="torch.cuda.is_available()",
                           got=f"False (torch {torch.__version__})")

    def leaf(a: Any) -> Any:  # on the device, a leaf whose .grad autograd fills
        return tensor(a).to(device).requires_grad_(True)

    opts = dict(inputs["options"])
    if "ce_weight" in opts:
        opts["ce_weight"] = tensor(np.array(opts["ce_weight"])).to(device)  # [V]: a copy
    with Handed(inputs) as c:
        loss_fn = _call(spec, cls, **opts)
        h, E = leaf(c["h"]), leaf(c["E"])
        y = tensor(c["targets"]).to(device)
        b = None if c["b"] is None else leaf(c["b"])
        # without a bias the module is called with three arguments: most real kernels take none
        loss = _call(spec, loss_fn, E, h, y) if b is None else _call(spec, loss_fn, E, h, y, b)
        if not isinstance(loss, torch.Tensor):
            raise AdapterError(spec, "the loss is not a tensor", expected="a torch.Tensor",
                               got=type(loss).__name__)
        go = c["grad_output"]

        def backward() -> None:
            if go is not None and loss.dim() == 1:
                upstream = tensor(go).to(device=loss.device, dtype=loss.dtype)
                loss.backward(upstream)  # type: ignore[no-untyped-call]
            else:
                loss.backward()  # type: ignore[no-untyped-call]

        _call(spec, backward)
        mutated = c.mutated()

    def grad(t: Any, shape: tuple[int, ...]) -> Any:  # back on the CPU by _returned
        return t.grad if t.grad is not None else torch.zeros(shape, dtype=t.dtype)

    out = {"loss": loss.detach(), "dh": grad(h, tuple(h.shape)), "dE": grad(E, tuple(E.shape)),
           "db": None if b is None else grad(b, tuple(b.shape))}
    return _readable(spec, lambda: _returned(spec, inputs, out, mutated))
