"""Reference gradients derived symbolically with sympy, both paths kept apart.

The loss is written with the two uses of E as separate symbol matrices, ``E_in`` (lookup) and
``E_out`` (scoring).  The lookup is written as ``x = s_in * p @ E_in`` with ``p`` the one-hot row of
the token, itself a vector of symbols filled in at evaluation time: one compiled function then
serves every token, target and batch length for a given (V, d), and a repeated token's row
accumulates because the derivative of the batch mean is the sum of the positions' derivatives,
not because we wrote a scatter-add.  The target enters the same way as a one-hot ``y``.  The
tied reference is ``dL/dE_in + dL/dE_out`` evaluated at ``E_in = E_out = E``.

Cost grows super-linearly with V*d*N, so this is for small shapes; compiled functions are cached
per (V, d, has_bias) in each process, and the source sympy generates for each on disk
(:func:`cache_dir`): deriving the shapes a property run meets cost ~4.5 CPU-s in every process
(each pytest-xdist worker derived its own), most of the plugin quick start's CPU, while
loading the saved source costs a millisecond.  The file's name holds a digest of this module
and sympy's version, so a changed derivation or sympy derives afresh.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

import numpy as np

# sympy loads only to derive: a process whose shapes are all saved (every run after the first,
# the plugin's and ``assert_correct``'s included) runs the saved numpy source without it
# (its import is 0.24 CPU-s here, issue 53).
if TYPE_CHECKING:
    import sympy as sp

from tyingspec._src.core.files import atomic_write
from tyingspec._src.core.paths import Array, Paths, flatten_batch, forward_parts, model_terms

#: Beyond this many entries in E (V*d) the derivation takes seconds per shape; use the closed form.
MAX_SYMBOLIC_ENTRIES = 12


def _matrix(name: str, rows: int, cols: int) -> sp.Matrix:
    import sympy as sp

    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}_{j}", real=True))


#: The environment variable naming the directory of derived sources; set to "" to derive in
#: every process and save nothing.
CACHE_ENV = "TYINGSPEC_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where derived sources are saved: ``$TYINGSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tyingspec/symbolic`` (``~/.cache/...``); None when the variable is
    set empty."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tyingspec" / "symbolic"


@functools.cache
def _digest() -> str:
    """What a saved source was derived by: this module's text and sympy's version."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(_sympy_version().encode())
    return h.hexdigest()[:16]


def _sympy_version() -> str:
    """sympy's version from its installed metadata, without importing it."""
    from importlib import metadata

    try:
        return metadata.version("sympy")
    except metadata.PackageNotFoundError:  # sympy on the path without its metadata
        import sympy

        return str(sympy.__version__)


@functools.cache
def compiled(V: int, d: int, has_bias: bool) -> Callable[..., tuple[Any, ...]]:
    """:func:`derived` for this shape, from its saved source when there is one (see
    :func:`cache_dir`); a source derived here is saved for the next process.  A saved file
    that cannot be read or run is derived afresh: the cache is never the reason a check
    fails."""
    where = cache_dir()
    path = None if where is None else \
        where / f"{_digest()}-{V}x{d}{'-bias' if has_bias else ''}.py"
    if path is not None and path.is_file():
        try:
            code = compile(path.read_text(encoding="utf-8"), str(path), "exec")
            namespace = _saved_namespace(code)
            exec(code, namespace)
            fn: Callable[..., tuple[Any, ...]] = namespace["_lambdifygenerated"]
            return fn
        except Exception:  # noqa: BLE001 - a damaged file: derive, and save over it
            pass
    fn = derived(V, d, has_bias)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(str(path), inspect.getsource(fn))
        except (OSError, TypeError):  # a read-only home, a source sympy did not keep
            pass
    return fn


@functools.cache
def _numpy_namespace() -> dict[str, Any]:
    """The names sympy's numpy printer's code runs with (``exp``, ``log``, ``tanh``, ...)."""
    import sympy as sp

    return dict(sp.lambdify([], 0, modules="numpy").__globals__)


def _names(code: CodeType) -> Iterator[str]:
    """Every global or attribute name ``code`` and the functions in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def _saved_namespace(code: CodeType) -> dict[str, Any]:
    """What a saved source runs with: numpy's functions of the names it uses (sympy's numpy
    printer writes numpy's names, ``tanh``, ``exp``, ``log``: the namespace above takes them
    from ``numpy``), or, for a name numpy lacks, sympy's own namespace."""
    names = set(_names(code))
    namespace = {n: getattr(np, n) for n in names if hasattr(np, n)}
    if names - namespace.keys() - set(dir(builtins)) - {"_lambdifygenerated"}:
        return dict(_numpy_namespace())
    return namespace


def derived(V: int, d: int, has_bias: bool) -> Callable[..., tuple[Any, ...]]:
    """Derive and compile one position's loss and its gradients as a numpy function.

    Outputs, flattened: loss, dl/dE_in (V*d), dl/dE_out (V*d), dl/dW (d*d), dl/db (V if bias).
    The one-hot symbols ``p`` (token) and ``y`` (target) may be fed arrays of length N: the
    function then evaluates every position at once and the batch mean is a sum over that axis.
    """
    import sympy as sp

    E_in = _matrix("Ein", V, d)
    E_out = _matrix("Eout", V, d)
    W = _matrix("W", d, d)
    b = _matrix("b", 1, V) if has_bias else sp.zeros(1, V)
    p = _matrix("p", 1, V)
    y = _matrix("y", 1, V)
    res, s_in = sp.symbols("res s_in", real=True)

    x = s_in * (p * E_in)  # [1, d]: the lookup E_in[t] written as onehot(t) @ E_in
    h = res * x + (x * W).applyfunc(sp.tanh)
    z = h * E_out.T + b  # [1, V]
    loss = sp.log(sum(sp.exp(z[0, v]) for v in range(V))) - sum(y[0, v] * z[0, v]
                                                                 for v in range(V))
    wrt = list(E_in) + list(E_out) + list(W) + (list(b) if has_bias else [])
    outputs = [loss] + [sp.diff(loss, s) for s in wrt]
    args = [list(E_in), list(E_out), list(W), list(b) if has_bias else [], list(p), list(y),
            res, s_in]
    fn: Callable[..., tuple[Any, ...]] = sp.lambdify(args, outputs, modules="numpy", cse=True)
    return fn


def symbolic_paths(
    E: Array,
    W: Array,
    b: Array | None,
    tokens: object,
    targets: object,
    res: float = 1.0,
    s_in: float = 1.0,
    *,
    E_out: Array | None = None,
) -> Paths:
    """Reference gradients from the sympy derivation (small shapes only), float64."""
    t, y = flatten_batch(tokens, targets)
    E = np.asarray(E, dtype=np.float64)
    out = E if E_out is None else np.asarray(E_out, dtype=np.float64)
    W = np.asarray(W, dtype=np.float64)
    V, d = E.shape
    N = t.shape[0]
    if V * d > MAX_SYMBOLIC_ENTRIES:
        raise ValueError(f"symbolic reference: V*d = {V * d} exceeds {MAX_SYMBOLIC_ENTRIES}; "
                         "use the closed-form reference")
    fn = compiled(V, d, b is not None)
    eye = np.eye(V)
    P, Yh = eye[t], eye[y]  # [N, V] one-hots; column v is fed to symbol p_v / y_v
    bias = [] if b is None else list(np.asarray(b, dtype=np.float64).reshape(-1))
    flat = fn(list(E.reshape(-1)), list(out.reshape(-1)), list(W.reshape(-1)), bias,
              list(P.T), list(Yh.T), float(res), float(s_in))
    # Mean over positions; entries that do not depend on the position come back as scalars.
    vals = np.array([np.broadcast_to(np.asarray(v, dtype=np.float64), (N,)).sum() / N
                     for v in flat])
    loss, vals = vals[0], vals[1:]
    g_in, g_out = vals[: V * d].reshape(V, d), vals[V * d: 2 * V * d].reshape(V, d)
    g_W = vals[2 * V * d: 2 * V * d + d * d].reshape(d, d)
    db = vals[2 * V * d + d * d:].reshape(V) if b is not None else None
    # Per-position input-path rows are not a symbolic output; the diagnosis uses them only to
    # explain duplicate bugs, so take them from the closed form's scatter structure.
    parts = forward_parts(E, out, W, b, t, y, res, s_in)
    return Paths(loss=float(loss), dE_in=g_in, dE_out=g_out, dW=g_W, db=db,
                 per_position=parts.input_rows, tokens=t,
                 terms=model_terms(E, out, W, b, t, y, res, s_in, parts)[0])
