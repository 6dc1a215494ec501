"""Adapters: how a user's implementation plugs in, and the validation of what it returns.

A target is either a built-in name (see ``tyingspec check --list``) or ``module:attr``, imported
on demand.  Two contracts:

* model adapter: ``f(E, W, b, tokens, targets, *, res, s_in) -> {"loss", "dE", "dW", "db"}``
* kernel adapter: ``f(tokens, dx, h, g, vocab_size) -> dE`` where ``dx`` is the gradient with
  respect to the looked-up rows ``E[tokens]`` (``s_in`` already applied), ``h`` the hidden
  states and ``g`` the logit gradient.

Everything an adapter returns is converted (torch tensors, jax arrays, lists) and validated; any
problem raises :class:`AdapterError`, which names the adapter, the key, what was expected and
what came back.  Adapters get copies of their inputs (the largest, the inputs themselves, kept
in a temporary file: :class:`Handed`); a mutation is reported, not absorbed.
"""

from __future__ import annotations

import inspect
import tempfile
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from tyingspec._src.core.errors import TyingspecError
from tyingspec._src.core.findings import Finding
from tyingspec._src.core.tolerance import Precision, least_precise, numpy_dtype


class AdapterError(TyingspecError):
    """The adapter could not be loaded, raised, or returned something unusable."""

    def __init__(self, adapter: str, problem: str, *, key: str | None = None,
                 expected: str | None = None, got: str | None = None) -> None:
        self.adapter, self.problem, self.key = adapter, problem, key
        self.expected, self.got = expected, got
        where = f" key {key!r}:" if key else ""
        msg = f"adapter {adapter!r}:{where} {problem}"
        if expected is not None:
            msg += f"; expected {expected}"
        if got is not None:
            msg += f", got {got}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        # crosses the worker's pipe: rebuild from the fields, not from the message
        return (_adapter_error, (self.adapter, self.problem, self.key, self.expected, self.got))


def _adapter_error(adapter: str, problem: str, key: str | None, expected: str | None,
                   got: str | None) -> AdapterError:
    return AdapterError(adapter, problem, key=key, expected=expected, got=got)


def to_numpy(value: Any) -> np.ndarray:
    """Torch tensors, jax arrays, lists and numpy arrays as a numpy array."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor without importing torch
        t = value.detach().cpu()
        if str(getattr(t, "dtype", "")) == "torch.bfloat16":  # numpy has no bfloat16 of its own
            import torch

            # ml_dtypes' bfloat16 has torch's bit layout: the bits copied once, not through a
            # float32 array twice the size (2.1 GB for a dE at Llama-3's head)
            bits = t.view(dtype=torch.int16).numpy()
            return np.array(bits.view(numpy_dtype("bfloat16")), copy=True)
        value = t.numpy()
    return np.asarray(value)


def _describe(a: np.ndarray) -> str:
    return f"shape {tuple(a.shape)} dtype {a.dtype}"


def validate_array(
    adapter: str, key: str, value: Any, shape: tuple[int, ...] | None
) -> np.ndarray:
    """Convert and check one returned value; ``shape=None`` means a scalar (any 1-element shape)."""
    if value is None:
        raise AdapterError(adapter, "missing value", key=key,
                           expected=f"float array of shape {shape}", got="None")
    try:
        a = to_numpy(value)
    except Exception as exc:
        raise AdapterError(adapter, "cannot be converted to a numpy array", key=key,
                           got=f"{type(value).__name__} ({type(exc).__name__}: {exc})") from exc
    if a.dtype.kind in "iub" and shape is None:
        a = a.astype(np.float64)  # a Python/numpy int loss is fine; only arrays must be float
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise AdapterError(adapter, "wrong dtype kind", key=key,
                           expected=f"floating dtype, shape {shape}", got=_describe(a))
    if (a.size != 1) if shape is None else (a.shape != shape):
        raise AdapterError(adapter, "wrong shape", key=key,
                           expected="a scalar" if shape is None else f"shape {shape}",
                           got=_describe(a))
    if not _finite_sum(a):  # a NaN or inf entry, or finite entries whose sum overflows
        bad = ~np.isfinite(a)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AdapterError(adapter, "non-finite values", key=key,
                               expected="finite floats",
                               got=f"{int(bad.sum())} NaN/inf entries, first at {first}")
    return a


def _finite_sum(a: np.ndarray) -> bool:
    """Whether ``a``'s sum is finite: then so is every entry (a NaN or an inf makes the sum
    NaN or inf).  One read of ``a`` and no temporary, where ``np.isfinite`` writes a bool array
    as large as ``a`` (0.1 s of fresh memory at GPT-2 size).  Summed in float32 at least (cast
    chunk by chunk), so that float16's small range rarely sends it to the entrywise check."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN sums are answers here
        return bool(np.isfinite(a.sum(dtype=np.promote_types(a.dtype, np.float32))))



def model_batch(adapter: str, inputs: Mapping[str, Any], batch_size: int, vocab: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """A model's tokens and targets as ``[batch_size, T]`` arrays, after checking the batch
    splits into its batch size and every token id is in its vocabulary (a torch or jax model
    would raise an IndexError inside its embedding, a traceback instead of this message)."""
    tokens = np.asarray(inputs["tokens"], dtype=np.int64)
    targets = np.asarray(inputs["targets"], dtype=np.int64)
    if tokens.size % batch_size:
        raise AdapterError(adapter, "the batch does not split into the model's batch size",
                           key="tokens", expected=f"a multiple of {batch_size} tokens",
                           got=f"{tokens.size} tokens")
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if bad.size:
        raise AdapterError(adapter, "token ids outside the model's vocabulary", key="tokens",
                           expected=f"ids in [0, {vocab})", got=f"{bad[:8].tolist()}")
    return tokens.reshape(batch_size, -1).copy(), targets.reshape(batch_size, -1).copy()


@dataclass(frozen=True)
class Returned:
    """What an adapter returned, validated: dE always; loss, dW, db for kinds that return them."""

    dE: np.ndarray
    mutated: tuple[str, ...]
    precision: Precision  # the least precise float among the returned arrays
    loss: float | None = None
    dW: np.ndarray | None = None
    db: np.ndarray | None = None
    # kinds whose reference is observed where the target runs (torch): what was observed,
    # and the named checks beyond rows (see core.findings)
    evidence: Mapping[str, Any] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()


def _guarded_call(adapter: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        raise AdapterError(adapter, "raised an exception",
                           got=f"{type(exc).__name__}: {exc}{where}") from exc


class PrivateInputs(dict[str, Any]):
    """Inputs of which those named in ``private`` are the adapter's own already: arrays a
    worker process received through shared memory, written there for this call alone (see
    :mod:`engine.isolation`).  They are handed to the adapter as they are: a copy would
    only cost a pass over fresh memory (0.3-0.5 s for a GPT-2-size E), and a write into one is
    found by whoever made it private (the worker's parent compares each block with the array
    it wrote there).  Every other input is copied and compared as usual."""

    def __init__(self, inputs: Mapping[str, Any], private: Iterable[str]) -> None:
        super().__init__(inputs)
        self.private = frozenset(private)


#: An input array of at least this many bytes is handed to the adapter itself, its bytes kept
#: in an unnamed temporary file: a copy held beside it is another 2.1 GB at Llama-3's head
#: (float32 E), where the kernel's own forward+backward holds E and its gradient.  After the
#: call the array is compared with the file block by block and, if written into, put back
#: from it (so the rest of the check judges the inputs it drew).  Below this, a copy in memory.
#: The file is in ``tempfile``'s directory (``TMPDIR``): where that is a tmpfs, it is memory
#: after all, as much as the copy was.
SPILL_ABOVE = 1 << 28

#: Bytes :func:`same_bits` compares at a time: its temporary stays small and warm, where one
#: the size of a GPT-2-size E is 38 MB of fresh memory (up to 0.1 s of page faults).
_COMPARE_BYTES = 1 << 20

#: Bytes one read or write of a spill file moves (Linux moves at most 2 GiB - 4 KiB per call).
_SPILL_IO = 1 << 26


def _spillable(v: Any, name: str, private: frozenset[str]) -> bool:
    # writeable: torch.from_numpy (the torch form) refuses to share a read-only array
    return (isinstance(v, np.ndarray) and name not in private and v.nbytes >= SPILL_ABOVE
            and v.flags.c_contiguous and v.flags.writeable)


def _bytes_of(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data  # a view: only a C-contiguous array is spilled


class Handed(dict[str, Any]):
    """The arguments one call hands to an adapter: a copy of each input array, the input
    itself where it is private already (see :class:`PrivateInputs`) or spilled (see
    :data:`SPILL_ABOVE`).  :meth:`mutated` says which inputs the adapter wrote into and puts a
    spilled one back (:meth:`unaliased` then reads a result built in its buffer from what was
    written); :meth:`close` (also on the way out of ``with``, an exception included) puts
    back and lets the files go."""

    def __init__(self, inputs: Mapping[str, Any]) -> None:
        private = inputs.private if isinstance(inputs, PrivateInputs) else frozenset()
        self.inputs = inputs
        self.spilled: dict[str, IO[bytes]] = {}
        self.written: dict[str, np.ndarray] = {}  # see unaliased
        super().__init__()
        try:
            for k, v in inputs.items():
                f = spill(v) if _spillable(v, k, private) else None
                if f is not None:
                    self.spilled[k] = f
                    self[k] = v
                elif isinstance(v, np.ndarray) and k not in private:
                    self[k] = np.array(v, copy=True)
                else:
                    self[k] = v
        except BaseException:  # nothing was handed over yet: nothing to put back
            for f in self.spilled.values():
                f.close()
            raise

    def __enter__(self) -> Handed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mutated(self, returned: Any = None) -> tuple[str, ...]:
        """The inputs the adapter wrote into, in the inputs' order (a spilled one is put back
        and its file let go); one handed uncopied because it is private has nothing here to
        be compared with and is checked by whoever made it private.  ``returned`` is what the
        adapter returned: what it wrote into a spilled input is kept, for :meth:`unaliased`,
        only where an array of it is a view of that input (a copy of a 2.1 GB E otherwise)."""
        out = []
        for k, orig in self.inputs.items():
            if k in self.spilled:
                if self._put_back(k, keep=_views_of(returned, orig)):
                    out.append(k)
            elif isinstance(orig, np.ndarray) and self[k] is not orig and \
                    not same_bits(orig, self[k]):
                out.append(k)
        return tuple(out)

    def close(self) -> None:
        """Put back every spilled input not compared yet and let the files go."""
        while self.spilled:
            self._put_back(next(iter(self.spilled)))

    def unaliased(self, out: Any) -> Any:
        """What the adapter returned (an array, or a dict of them), where an array is a view
        of a spilled input it wrote into (a dE built in E's own buffer) read from what it
        wrote, not from the input put back: as it would have been with a copy handed over."""
        if not self.written:
            return out
        if isinstance(out, Mapping):  # as mutated() reads it (_views_of)
            return {k: self._unalias(v) for k, v in out.items()}
        return self._unalias(out)

    def _unalias(self, a: Any) -> Any:
        if not isinstance(a, np.ndarray):
            return a
        for k, kept in self.written.items():
            base = self.inputs[k]
            if np.shares_memory(a, base):
                try:
                    return np.ndarray(a.shape, a.dtype, buffer=kept, strides=a.strides,
                                      offset=a.ctypes.data - base.ctypes.data)
                except (TypeError, ValueError):  # reaches outside the input: left as it is
                    return a
        return a

    def _put_back(self, k: str, keep: bool = False) -> bool:
        """Whether the spilled input ``k`` differs from its file, put back if so (``keep``:
        what was written is kept first, for :meth:`unaliased`); the file is closed either
        way."""
        f, raw = self.spilled.pop(k), _bytes_of(self.inputs[k])
        with f:
            f.seek(0)
            buf = bytearray(_COMPARE_BYTES)
            for i in range(0, len(raw), _COMPARE_BYTES):
                n = _read_into(f, memoryview(buf)[:min(_COMPARE_BYTES, len(raw) - i)], k)
                if not same_bits(np.frombuffer(buf, np.uint8, n),
                                 np.frombuffer(raw[i:i + n], np.uint8)):
                    if keep:  # a copy only now: the adapter wrote, as a copy is written
                        self.written[k] = np.array(self.inputs[k], copy=True)
                    f.seek(0)
                    for j in range(0, len(raw), _SPILL_IO):
                        _read_into(f, raw[j:j + _SPILL_IO], k)
                    return True
        return False


def _views_of(returned: Any, base: np.ndarray) -> bool:
    """Whether an array of ``returned`` (an array, or a dict of them) shares ``base``'s memory."""
    arrays = returned.values() if isinstance(returned, Mapping) else (returned,)
    return any(isinstance(a, np.ndarray) and np.shares_memory(a, base) for a in arrays)


def spill(a: np.ndarray) -> IO[bytes] | None:
    """An unnamed temporary file holding ``a``'s bytes; None where it cannot be made or
    written (a ``TMPDIR`` that cannot be written to, a full disk: the input is copied in
    memory instead, as a smaller one is)."""
    try:
        f: IO[bytes] = tempfile.TemporaryFile(buffering=0)
    except OSError:
        return None
    try:
        raw = _bytes_of(a)
        for i in range(0, len(raw), _SPILL_IO):
            view = raw[i:i + _SPILL_IO]
            while len(view):  # a write may take less than it is given
                wrote = f.write(view)
                if not wrote:
                    raise OSError("the spill file took no bytes")
                view = view[wrote:]
    except OSError:
        f.close()
        return None
    return f


def _read_into(f: IO[bytes], view: memoryview, name: str) -> int:
    """Fill ``view`` from ``f`` (a read may return less than asked); its length."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            raise OSError(f"the spill file of input {name!r} ended {len(view) - done} bytes "
                          "early")
        done += got
    return done


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality on purpose: any write into an input is a mutation, even of an equal
    value (-0.0 over 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    word = next(w for w in (8, 4, 2, 1) if a.nbytes % w == 0)  # widest view that fits
    view = np.dtype(f"u{word}")
    a, b = a.view(np.uint8).view(view), b.view(np.uint8).view(view)
    step = _COMPARE_BYTES // word
    return all(np.array_equal(a[i:i + step], b[i:i + step]) for i in range(0, a.size, step))


def _returned_dtype(value: Any) -> Any:
    return getattr(value, "dtype", None) if not isinstance(value, float) else None


def _readable(adapter: str, read: Callable[[], Returned]) -> Returned:
    """Reading what an adapter returned runs its code too (a mapping's ``__getitem__``, a
    tensor's ``.numpy``): any failure there is the adapter's, reported as such."""
    try:
        return read()
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(adapter, "returned something that cannot be read",
                           got=f"{type(exc).__name__}: {exc}") from exc


def call_model(adapter: str, fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Returned:
    """Call a model adapter on copies of ``inputs`` and validate every returned value."""
    with Handed(inputs) as c:
        # padding_idx only when the case declares one: an adapter without it keeps its contract
        extra = {"padding_idx": c["padding_idx"]} if "padding_idx" in c else {}
        out = _guarded_call(adapter, fn, c["E"], c["W"], c["b"], c["tokens"], c["targets"],
                            res=c["res"], s_in=c["s_in"], **extra)
        mutated = c.mutated(out)
        out = c.unaliased(out)
    return _readable(adapter, lambda: _model_returned(adapter, inputs, out, mutated))


def _model_returned(adapter: str, inputs: Mapping[str, Any], out: Any,
                    mutated: tuple[str, ...]) -> Returned:
    if not isinstance(out, Mapping):
        raise AdapterError(adapter, "returned a non-mapping",
                           expected="a mapping with keys loss, dE, dW, db",
                           got=type(out).__name__)
    for key in ("loss", "dE", "dW", "db"):
        if key not in out:
            raise AdapterError(adapter, "missing key", key=key,
                               expected="keys loss, dE, dW, db",
                               got="keys " + ", ".join(sorted(map(repr, out))))
    E, b = inputs["E"], inputs["b"]
    V, d = E.shape
    loss = validate_array(adapter, "loss", out["loss"], None)
    dE = validate_array(adapter, "dE", out["dE"], (V, d))
    dW = validate_array(adapter, "dW", out["dW"], (d, d))
    if b is None:
        if out["db"] is not None:
            raise AdapterError(adapter, "db must be None when the model has no bias", key="db",
                               expected="None", got=_describe(to_numpy(out["db"])))
        db = None
    else:
        db = validate_array(adapter, "db", out["db"], (V,))
    precision = least_precise(dE.dtype, dW.dtype, None if db is None else db.dtype,
                              _returned_dtype(out["loss"]))
    return Returned(dE, mutated, precision, float(loss.reshape(())), dW, db)


def call_kernel(adapter: str, fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Returned:
    """Call a kernel adapter on copies of ``inputs``; returns the validated dE."""
    with Handed(inputs) as c:
        out = _guarded_call(adapter, fn, c["tokens"], c["dx"], c["h"], c["g"],
                            c["vocab_size"])
        mutated = c.mutated(out)
        out = c.unaliased(out)

    def read() -> Returned:
        dE = validate_array(adapter, "dE", out,
                            (int(inputs["vocab_size"]), inputs["dx"].shape[1]))
        return Returned(dE, mutated, least_precise(dE.dtype))

    return _readable(adapter, read)


def signature_problem(fn: Callable[..., Any], positional: tuple[str, ...],
                      keywords: tuple[str, ...]) -> str | None:
    """Why ``fn`` cannot be called as ``fn(*positional, **keywords)``; None when it can (or
    when its signature cannot be read, e.g. a C function)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        return f"{exc} (its signature is {fn.__name__ if hasattr(fn, '__name__') else 'f'}{sig})"
    return None
