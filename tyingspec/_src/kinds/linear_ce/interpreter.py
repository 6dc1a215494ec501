"""Triton kernels on the CPU: the Triton interpreter, switched on and its known gaps filled.

A Triton kernel runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
before ``triton`` is imported: ``@triton.jit`` then makes an interpreted function, every
program of the grid run in numpy).  A GitHub runner has no GPU, so this is how a kernel
author's CI checks a kernel; :func:`before_import` switches it on in the worker process,
before the target is imported, when triton is installed, no GPU is there and the user has not
said otherwise (their own ``TRITON_INTERPRET`` is kept, either way).

The interpreter of triton 3.8 and 3.9 lacks three things real kernels use (found on Liger-Kernel's
cross-entropy, 2026): a Python float argument stays a Python float (compiled Triton passes it
as an fp32 scalar, so Liger's ``softcap.to(tl.float32)`` raises ``'float' object has no
attribute 'to'``), and libdevice functions (``tanh``, ``log1p``: extern calls into CUDA's
libdevice, or, through ``triton.language.extra.libdevice``, stubs the compiler swaps for its
backend's) are not implemented; and a kernel module's own name for a ``triton.language``
builtin (Unsloth's ``triton_cast = tl.cast``, 2026) is not given the interpreter's semantic
as ``tl.cast`` is.  :func:`install` fills the three, each only where the installed triton
still lacks it, and never changes a kernel's arithmetic: the float becomes the fp32
scalar a compiled launch passes, and a libdevice function is the same function computed by
numpy in the same dtype (fp32 in fp32, fp64 in fp64).  What it cannot fill (inline assembly,
a libdevice function not in :data:`LIBDEVICE`) stays an error, which :func:`gap` names with
the triton version and the construct (the adapter's exit 2).

Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

#: The triton releases whose interpreter the fills are tested against
#: (``tests/kinds/linear_ce/test_triton_interpreter.py``: 3.9.0 from the ``triton`` extra,
#: 3.8.0 the one torch 2.14.1 brings, on which CI runs the torch tests again).  Another
#: release still gets each fill whose gap it is found to have (a fill is applied only where the
#: gap shows), and a gap left is named.
SUPPORTED = ("3.8.0", "3.9.0")

#: Device files whose presence means a GPU may be there (NVIDIA's driver, AMD's KFD): only
#: then is torch imported to ask (a numpy kernel's worker never pays torch's import for it).
_GPU_FILES = ("/dev/nvidiactl", "/dev/kfd")

#: libdevice functions filled, by name: (numpy function, number of arguments).  CUDA's symbols
#: are ``__nv_<name>f`` (fp32) and ``__nv_<name>`` (fp64), ROCm's ``__ocml_<name>_f32`` and
#: ``_f64``; each is computed by numpy in that dtype.
LIBDEVICE: dict[str, tuple[Callable[..., Any], int]] = {
    "tanh": (np.tanh, 1), "log1p": (np.log1p, 1), "expm1": (np.expm1, 1),
    "exp": (np.exp, 1), "exp2": (np.exp2, 1), "log": (np.log, 1), "log2": (np.log2, 1),
    "log10": (np.log10, 1), "sqrt": (np.sqrt, 1), "rsqrt": (lambda x: 1 / np.sqrt(x), 1),
    "sin": (np.sin, 1), "cos": (np.cos, 1), "tan": (np.tan, 1), "sinh": (np.sinh, 1),
    "cosh": (np.cosh, 1), "asin": (np.arcsin, 1), "acos": (np.arccos, 1),
    "atan": (np.arctan, 1), "asinh": (np.arcsinh, 1), "acosh": (np.arccosh, 1),
    "atanh": (np.arctanh, 1), "fabs": (np.abs, 1), "floor": (np.floor, 1),
    "ceil": (np.ceil, 1), "trunc": (np.trunc, 1), "cbrt": (np.cbrt, 1),
    "pow": (np.power, 2), "atan2": (np.arctan2, 2), "fmod": (np.fmod, 2),
    "hypot": (np.hypot, 2), "copysign": (np.copysign, 2), "fmax": (np.fmax, 2),
    "fmin": (np.fmin, 2),
}

#: The triton modules whose functions a kernel calls for libdevice: the dispatching stubs
#: (which the compiler replaces by its backend's; under the interpreter they return None) and
#: the backends' own (extern calls, which need the interpreter's ``_semantic``).
_STUBS = "triton.language.extra.libdevice"
_BACKENDS = ("triton.language.extra.cuda.libdevice", "triton.language.extra.hip.libdevice")

#: What :func:`install` filled in this process (empty until it runs, or when nothing needed it).
FILLED: list[str] = []
_INSTALLED: list[bool] = []
#: The block sizes Triton launches used in this process: each ``tl.constexpr`` argument whose
#: name has ``BLOCK`` in it, by kernel (see :func:`largest_block`).
BLOCKS: dict[str, dict[str, int]] = {}
#: The Triton kernels launched (interpreted) in this process, by name: a target is judged as
#: interpreted only when its own call launched one (torch alone imports triton: a numpy or
#: plain torch kernel in a process where triton is loaded is not interpreted).
LAUNCHED: set[str] = set()


def gpu_present() -> bool:
    """Whether torch sees a CUDA (or ROCm) device; False without asking torch where no GPU
    driver's device file exists."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in _GPU_FILES):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def before_import() -> None:
    """Switch the Triton interpreter on for the target about to be imported in this process
    (a check's worker): when triton is installed, ``TRITON_INTERPRET`` is not set and no GPU is
    there.  It must be set before triton is imported: ``@triton.jit`` reads it as the
    kernel's module is imported."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is None or gpu_present():
        return
    os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> str | None:
    """The triton version whose interpreter runs this process's Triton kernels, or None (no
    triton imported, or compiled kernels)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") or \
            "triton" not in sys.modules:
        return None
    return str(getattr(sys.modules["triton"], "__version__", "unknown"))


def install() -> list[str]:
    """Fill the interpreter's gaps in this process, once (see the module docstring); what was
    filled.  Nothing is done unless triton is imported and interpreting."""
    if _INSTALLED or interpreting() is None:
        return FILLED
    _INSTALLED.append(True)
    # by name: triton is optional, untyped, and loaded only where a kernel brought it in
    interp = importlib.import_module("triton.runtime.interpreter")

    if _fill_float_arguments(interp):
        FILLED.append("a Python float argument is an fp32 scalar, as in a compiled launch")
    if _fill_extern_elementwise(interp):
        FILLED.append(f"{len(LIBDEVICE)} libdevice functions (tanh, log1p, exp, ...) in "
                      "numpy, in the argument's dtype")
    if _fill_builtin_aliases(interp):
        FILLED.append("a kernel module's own name for a triton.language builtin (Unsloth's "
                      "`triton_cast = tl.cast`) runs as the builtin itself does")
    _record_blocks(interp)
    return FILLED


def _fill_float_arguments(interp: Any) -> bool:
    """``_implicit_cvt(1.5)`` as the fp32 scalar a compiled launch passes, where the
    interpreter leaves it a Python float; False when it does not (nothing to fill) or has no
    ``_implicit_cvt`` (another interpreter: its gap, if any, is named when a kernel hits it)."""
    original = getattr(interp, "_implicit_cvt", None)
    if original is None or not isinstance(original(0.5), float):
        return False
    tl = importlib.import_module("triton.language")
    mangle_type = importlib.import_module("triton.runtime.jit").mangle_type

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            ty = tl.str_to_ty(mangle_type(arg), None)
            dtype = np.float64 if ty == tl.float64 else np.float32
            return tl.tensor(interp.TensorHandle(np.array([arg], dtype=dtype), ty), ty)
        return original(arg)

    interp._implicit_cvt = implicit_cvt
    return True


def _symbol(symbol: str) -> tuple[str, Any] | None:
    """(name, numpy dtype) of a libdevice symbol ``__nv_tanhf`` / ``__ocml_tanh_f32``."""
    for prefix, f32, f64 in (("__nv_", "f", ""), ("__ocml_", "_f32", "_f64")):
        if not symbol.startswith(prefix):
            continue
        body = symbol[len(prefix):]
        if f32 and body.endswith(f32) and body[:-len(f32)] in LIBDEVICE:
            return body[:-len(f32)], np.float32
        plain = body[:-len(f64)] if f64 and body.endswith(f64) else body
        if plain in LIBDEVICE:
            return plain, np.float64
    return None


def _fill_extern_elementwise(interp: Any) -> bool:
    """libdevice calls under the interpreter: the builder's ``create_extern_elementwise``
    (which raises in triton 3.9) computes the functions of :data:`LIBDEVICE` in numpy, and a
    kernel's libdevice names (imported functions, or the module) are given the interpreter's
    semantic as ``triton.language`` itself is; False when the interpreter already has them."""
    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is None or not _raises_not_implemented(builder):
        return False

    def create_extern_elementwise(self: Any, lib_name: str, lib_path: str, symbol: str,
                                  args: list[Any], ret_type: Any, is_pure: bool) -> Any:
        found = _symbol(symbol)
        if found is None:
            raise NotImplementedError(f"the libdevice function {symbol}{_UNFILLED}")
        name, dtype = found
        fn, arity = LIBDEVICE[name]
        if len(args) != arity:
            raise NotImplementedError(f"the libdevice function {symbol} of {len(args)} "
                                      f"arguments{_UNFILLED}")
        with np.errstate(all="ignore"):  # inf/NaN where the function has them, as on a GPU
            data = fn(*[np.asarray(a.data, dtype=dtype) for a in args])
        scalar = ret_type.scalar if hasattr(ret_type, "scalar") else ret_type
        return interp.TensorHandle(np.asarray(data).astype(interp._get_np_dtype(scalar)),
                                   scalar)

    builder.create_extern_elementwise = create_extern_elementwise
    original_patch = interp._patch_lang

    def patch_lang(fn: Any) -> Any:
        scope = original_patch(fn)
        _patch_libdevice(interp, fn, scope)
        return scope

    interp._patch_lang = patch_lang
    return True


def _fill_builtin_aliases(interp: Any) -> bool:
    """A kernel module's global bound to a ``triton.language`` builtin (``triton_cast =
    tl.cast``, taken at import) given the interpreter's semantic for the kernel's run, as
    ``_patch_lang`` gives ``tl.cast`` itself: the interpreter patches the ``triton.language``
    modules a kernel sees, not the kernel module's own names for their functions, and such a
    name raises "Did you forget to add @triton.jit ?".  False when the interpreter already
    patches such a name (nothing to fill) or has no ``_patch_lang``."""
    original_patch = getattr(interp, "_patch_lang", None)
    if original_patch is None or not _alias_left_raw(interp, original_patch):
        return False
    is_builtin = importlib.import_module("triton.language").core.is_builtin

    def patch_lang(fn: Any) -> Any:
        scope = original_patch(fn)
        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        names: dict[str, Any] = getattr(fn, "__globals__", {})
        if module is None or getattr(module, "__dict__", None) is not names:
            return scope
        for name, value in list(names.items()):
            owner = getattr(value, "__module__", None) or ""
            # libdevice names are _patch_libdevice's (a stub takes its backend's function)
            if owner.startswith("triton.language") and owner != _STUBS and \
                    owner not in _BACKENDS and is_builtin(value):
                scope.set_attr(module, name, _with_semantic(interp, value))
        return scope

    interp._patch_lang = patch_lang
    return True


def _alias_left_raw(interp: Any, patch: Callable[[Any], Any]) -> bool:
    """Whether ``patch`` (the interpreter's ``_patch_lang``) leaves a module's alias of
    ``tl.cast`` the raw builtin, tried on a function of a throwaway module."""
    import types

    tl = importlib.import_module("triton.language")
    raw = tl.cast
    module = types.ModuleType("_tyingspec_alias_probe")
    module.__dict__.update(tl=tl, alias=raw)
    fn = types.FunctionType((lambda: None).__code__, module.__dict__)
    sys.modules[module.__name__] = module
    try:
        scope = patch(fn)
        try:
            # tl.cast itself patched for the run, the module's own name for it left raw
            return tl.cast is not raw and module.__dict__["alias"] is raw
        finally:
            scope.restore()
    except Exception:  # noqa: BLE001  (another interpreter: its gap is named when hit)
        return False
    finally:
        del sys.modules[module.__name__]


def _raises_not_implemented(builder: Any) -> bool:
    try:
        builder.create_extern_elementwise(builder, "", "", "__nv_tanhf", [], None, True)
    except NotImplementedError:
        return True
    except Exception:  # noqa: BLE001  (implemented: it failed on the empty arguments)
        return False
    return False


def _patch_libdevice(interp: Any, fn: Any, scope: Any) -> None:
    """For the run of ``fn``: the libdevice names of its module (functions imported from the
    stubs or a backend, or the modules themselves) take the interpreter's semantic, a stub its
    CUDA backend's function (the compiler's own mapping), restored with ``scope``.  Only the
    names the module holds are touched: this runs at every call of a jitted function."""
    cuda = sys.modules.get(_BACKENDS[0]) or sys.modules.get(_BACKENDS[1])
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    names: dict[str, Any] = getattr(fn, "__globals__", {})
    if cuda is None or module is None or getattr(module, "__dict__", None) is not names:
        return
    for name, value in list(names.items()):
        if isinstance(value, type(sys)):
            if value.__name__ == _STUBS:
                for attr in dir(value):
                    if hasattr(cuda, attr) and callable(getattr(value, attr)):
                        scope.set_attr(value, attr, _with_semantic(interp, getattr(cuda, attr)))
            elif value.__name__ in _BACKENDS:
                interp._patch_builtin(value, interp.interpreter_builder, scope)
            continue
        owner = getattr(value, "__module__", None)
        if owner == _STUBS and hasattr(cuda, getattr(value, "__name__", name)):
            scope.set_attr(module, name, _with_semantic(interp, getattr(cuda, value.__name__)))
        elif owner in _BACKENDS and callable(value):
            scope.set_attr(module, name, _with_semantic(interp, value))


_WRAPPED: dict[int, Callable[..., Any]] = {}


def _with_semantic(interp: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a backend's libdevice builtin) called with the interpreter's semantic, as the
    interpreter calls ``triton.language``'s builtins; one wrapper per function."""
    if id(fn) not in _WRAPPED:
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("_semantic", None)
            return fn(*args, **kwargs, _semantic=interp.interpreter_semantic)

        call.__name__ = getattr(fn, "__name__", "libdevice")
        _WRAPPED[id(fn)] = call
    return _WRAPPED[id(fn)]


def _record_blocks(interp: Any) -> None:
    """Each launch's block sizes into :data:`BLOCKS` (what :func:`largest_block` reads)."""
    executor = getattr(interp, "GridExecutor", None)
    if executor is None or getattr(executor, "_tyingspec_blocks", False):
        return
    call = executor.__call__

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        LAUNCHED.add(getattr(self.fn, "__name__", "kernel"))
        try:
            import inspect

            spec = inspect.getfullargspec(self.fn)  # launch options (num_warps) left out,
            known = set(spec.args) | set(spec.kwonlyargs)  # as the executor leaves them
            named = inspect.getcallargs(self.fn, *args,
                                        **{k: v for k, v in kwargs.items() if k in known})
            blocks = {k: int(v) for k, v in named.items()
                      if "BLOCK" in k.upper() and isinstance(v, int) and not isinstance(v, bool)}
            if blocks:
                seen = BLOCKS.setdefault(getattr(self.fn, "__name__", "kernel"), {})
                for k, v in blocks.items():
                    seen[k] = max(v, seen.get(k, 0))
        except Exception:  # noqa: BLE001  (recording must never break a launch)
            pass
        return call(self, *args, **kwargs)

    executor.__call__ = recording
    executor._tyingspec_blocks = True


def largest_block() -> int:
    """The largest block size a Triton launch in this process used (0: none seen)."""
    return max((v for blocks in BLOCKS.values() for v in blocks.values()), default=0)


#: How an unfilled libdevice function's error ends (see :func:`gap`).
_UNFILLED = ", which the Triton interpreter does not implement and tyingspec does not fill"

#: What a compiled Triton launch says of a CPU tensor (a GPU machine, ``--device cpu``).
_COMPILED_ON_CPU = "cannot be accessed from Triton (cpu tensor?)"

#: Messages of the interpreter's own gaps, and the construct each names.
_GAPS = (("extern_elementwise not supported", "a libdevice (extern) function"),
         ("inline_asm not supported", "inline assembly (tl.inline_asm_elementwise)"),
         (_UNFILLED, ""),
         ("object has no attribute 'to'", "a Python float argument used as a tensor "
                                          "(x.to(...))"))


def gap(exc: BaseException) -> str | None:
    """What interpreter gap ``exc`` (raised by a kernel call, or its cause) is: the triton
    version, the construct and the kernel's line; None when it is not one."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    version = interpreting()
    if version is None:
        compiled = "triton" in sys.modules and any(_COMPILED_ON_CPU in str(e) for e in seen)
        return (f"a compiled Triton kernel (triton {sys.modules['triton'].__version__}) was "
                f"handed CPU tensors{_kernel_line(seen)}: with a GPU here, run with --device "
                "cuda, or set TRITON_INTERPRET=1 for the Triton interpreter on the CPU"
                ) if compiled else None
    for e in reversed(seen):  # the innermost first: the construct's own message
        text = str(e)
        for marker, construct in _GAPS:
            if marker in text:
                what = construct or text.replace(_UNFILLED, "")
                tested = "" if version in SUPPORTED else \
                    f" (its fills are tested on triton {', '.join(SUPPORTED)})"
                return (f"the Triton interpreter of triton {version} cannot run {what}"
                        f"{_kernel_line(seen)}, and tyingspec cannot fill that gap (it filled: "
                        f"{'; '.join(FILLED) or 'nothing'}){tested}; run the kernel on a GPU "
                        "(--device cuda)")
    return None


def _kernel_line(chain: list[BaseException]) -> str:
    """`` (the kernel's line FILE:LINE: CODE)`` of the innermost frame outside triton, numpy
    and tyingspec, if any."""
    # lazy: only the package's folder is wanted, to tell its frames from the kernel's
    import tyingspec

    files = [getattr(m, "__file__", None) for m in (sys.modules.get("triton"), np, tyingspec)]
    roots = [os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f]
    for e in reversed(chain):  # the innermost exception's frames reach the kernel's line
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if not any(os.path.abspath(frame.filename).startswith(r) for r in roots):
                return (f" (the kernel's line {frame.filename}:{frame.lineno}: "
                        f"{(frame.line or '').strip()})")
    return ""
