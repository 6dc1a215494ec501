"""The wire format: what the worker sends its parent, as plain data, never a pickle.

User code runs in the worker and can forge anything the worker says (it can write to the pipe
itself), and unpickling runs whatever the bytes name, so nothing from the worker is unpickled:
each answer is one frame of plain data (a JSON tree of numbers, strings, containers and
tyingspec's own result types, then the raw bytes of its arrays, in a numeric dtype of a fixed
list).  :func:`_encode` makes a frame in the worker, :func:`_decode` reads one in the parent,
calling no function the frame names; a frame that is not of that form is :class:`_Refused`,
saying what was refused.  Both are plain functions of bytes and values: the format is tested
without a process (``tests/engine/test_wire_format.py``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from tyingspec._src.core.errors import TyingspecError


@dataclass(frozen=True)
class _Shared:
    """An array left in a named shared-memory block for the other process."""

    name: str
    shape: tuple[int, ...]
    dtype: str


# ---- the worker's answers: plain data, never a pickle ----------------------------------------

#: The first bytes of every frame the worker sends (a pickle starts with b"\x80"), then the
#: length of its JSON tree (an unsigned 64-bit little-endian integer), the tree, and the raw
#: bytes of its arrays, which the tree's array nodes locate by offset.
_MAGIC = b"tyingspec-worker-answer/1\n"
_HEAD = struct.Struct("<Q")
#: A legitimate answer nests a few levels deep; a deeper one is refused before it costs much.
_MAX_DEPTH = 32
#: The dtypes an array may cross in: numeric, byte order explicit (``np.dtype(...).str``), or
#: ml_dtypes' bfloat16 by name (its ``.str`` is the void ``<V2``).  No object, string, void or
#: structured dtype: an object dtype carries pickled objects, a structured one may hold them.
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
#: The fields of an AdapterError, all text or None: it crosses as these, not as itself.
_ERROR_FIELDS = ("adapter", "problem", "key", "expected", "got")


class _Unsendable(TyingspecError, TypeError):
    """A value the channel does not carry, found by the worker as it encodes an answer."""


class _Refused(TyingspecError, ValueError):
    """A frame from the worker that the parent does not take; the message says what it is."""


def _type_name(x: Any) -> str:
    kind = type(x)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"


def _dtype_token(dt: Any) -> str:
    """The name ``dt`` crosses the channel (and a shared block's description) under."""
    if dt.kind == "V" and dt.name == "bfloat16" and dt.fields is None:
        return "bfloat16"
    token = str(dt.str)
    if not _DTYPE.fullmatch(token) or dt.fields is not None or dt.subdtype is not None:
        raise _Unsendable(f"an array of dtype {dt}")
    return token


def _dtype_of(token: Any) -> Any:
    """The dtype named by ``token`` (see :func:`_dtype_token`); _Refused for any other."""
    import numpy as np

    if token == "bfloat16":
        from tyingspec._src.core.tolerance import numpy_dtype

        return numpy_dtype("bfloat16")
    if not isinstance(token, str) or not _DTYPE.fullmatch(token):
        raise _Refused(f"an array of dtype {token!r}"[:200])
    return np.dtype(token)


def _encode(answer: Any) -> bytes:
    """The frame that carries ``answer`` to the parent; _Unsendable names a value it cannot
    carry (anything but plain data, numeric arrays and tyingspec's own result types)."""
    import numpy as np

    from tyingspec._src.core.adapters import AdapterError, Returned
    from tyingspec._src.core.findings import Finding

    chunks: list[Any] = []
    size = 0

    def data(a: np.ndarray[Any, Any]) -> dict[str, Any]:
        nonlocal size
        token = _dtype_token(a.dtype)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # no copy when contiguous
        chunks.append(raw)
        size += raw.nbytes
        return {"dtype": token, "shape": list(a.shape), "at": size - raw.nbytes}

    def enc(x: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Unsendable("a value nested too deeply")
        if x is None or x is True or x is False:
            return x
        if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_)):
            return {"$": "scalar", **data(np.asarray(x))}
        if isinstance(x, str):
            return str(x)
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x)
        if isinstance(x, np.ndarray):
            return {"$": "array", **data(x)}
        if isinstance(x, list):
            return [enc(v, depth + 1) for v in x]
        if isinstance(x, (tuple, set, frozenset)):
            tag = "tuple" if isinstance(x, tuple) else \
                "frozenset" if isinstance(x, frozenset) else "set"
            return {"$": tag, "items": [enc(v, depth + 1) for v in x]}
        if isinstance(x, Mapping):
            return {"$": "dict", "items": [[enc(k, depth + 1), enc(v, depth + 1)]
                                           for k, v in x.items()]}
        if type(x) in (Returned, Finding, _Shared):
            return {"$": type(x).__name__,
                    "fields": {f.name: enc(getattr(x, f.name), depth + 1) for f in fields(x)}}
        if isinstance(x, AdapterError):  # a subclass too: it crosses as its fields
            text = {n: getattr(x, n, None) for n in _ERROR_FIELDS}
            bad = next((n for n, v in text.items() if v is not None and not isinstance(v, str)),
                       None)
            if bad is not None:
                raise _Unsendable(f"an AdapterError whose {bad} is an object of type "
                                  f"{_type_name(text[bad])}")
            return {"$": "AdapterError", "fields": {n: None if v is None else str(v)
                                                    for n, v in text.items()}}
        raise _Unsendable(f"an object of type {_type_name(x)}")

    head = json.dumps(enc(answer, 0), separators=(",", ":")).encode()
    return b"".join([_MAGIC, _HEAD.pack(len(head)), head, *chunks])


def _decode(frame: bytes) -> Any:
    """The answer a frame from the worker carries, built from plain data alone: no function
    the frame names is called, nothing is unpickled.  _Refused says what was refused."""
    if not frame.startswith(_MAGIC):
        raise _Refused("a pickle (the parent never unpickles what the worker sends)"
                       if frame[:1] == b"\x80" else
                       f"{len(frame)} bytes that are not a tyingspec message, starting "
                       f"{bytes(frame[:16])!r}")
    start = len(_MAGIC) + _HEAD.size
    if len(frame) < start:
        raise _Refused("a truncated message")
    (n,) = _HEAD.unpack_from(frame, len(_MAGIC))
    if n > len(frame) - start:
        raise _Refused(f"a message whose header claims {n} bytes, of {len(frame) - start}")
    try:
        tree = json.loads(frame[start:start + n])
        return _Decoder(memoryview(frame)[start + n:]).value(tree, 0)
    except _Refused:
        raise
    except RecursionError:
        raise _Refused("a message nested too deeply") from None
    except Exception as exc:  # noqa: BLE001  (malformed in any way: refused, not a traceback)
        raise _Refused(f"a malformed message ({type(exc).__name__}: {exc})"[:300]) from None


class _Decoder:
    """Plain values from a frame's JSON tree and the array bytes that follow it."""

    def __init__(self, body: memoryview) -> None:
        self.body = body

    def value(self, node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Refused("a message nested too deeply")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.value(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise _Refused(f"a value of type {type(node).__name__}")
        tag = node.get("$")
        if tag in ("array", "scalar"):
            _keys(node, "$", "dtype", "shape", "at")
            a = self.array(node)
            if tag == "scalar":
                if a.shape != ():
                    raise _Refused(f"a scalar of shape {a.shape}")
                return a[()]
            return a
        if tag in ("tuple", "set", "frozenset", "dict"):
            _keys(node, "$", "items")
            items = node["items"]
            if not isinstance(items, list):
                raise _Refused(f"a {tag} whose items are not a list")
            if tag == "dict":
                if not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
                    raise _Refused("a dict whose items are not pairs")
                return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in items}
            values = [self.value(v, depth + 1) for v in items]
            return tuple(values) if tag == "tuple" else set(values) if tag == "set" \
                else frozenset(values)
        if tag in ("Returned", "Finding", "_Shared", "AdapterError"):
            _keys(node, "$", "fields")
            given = node["fields"]
            if not isinstance(given, dict):
                raise _Refused(f"a {tag} whose fields are not a mapping")
            return _build(tag, {str(k): self.value(v, depth + 1) for k, v in given.items()})
        raise _Refused(f"an object tagged {tag!r}"[:200])

    def array(self, node: dict[str, Any]) -> Any:
        import numpy as np

        dt = _dtype_of(node["dtype"])
        shape, at = node["shape"], node["at"]
        if not (isinstance(shape, list) and len(shape) <= 32 and
                all(type(s) is int and s >= 0 for s in shape)):
            raise _Refused(f"an array of shape {shape!r}"[:200])
        if type(at) is not int or at < 0:
            raise _Refused(f"an array at offset {at!r}"[:200])
        nbytes = math.prod(shape) * dt.itemsize
        if at + nbytes > len(self.body):
            raise _Refused(f"an array of {nbytes} bytes where the message has "
                           f"{max(len(self.body) - at, 0)}")
        if nbytes == 0:
            return np.zeros(shape, dtype=dt)
        # a copy: the array is this process's own, writable and aligned (as unpickled)
        return np.frombuffer(self.body[at:at + nbytes], dtype=dt).reshape(shape).copy()


def _keys(node: dict[str, Any], *keys: str) -> None:
    if set(node) != set(keys):
        raise _Refused(f"a {node.get('$')!r} node with keys {sorted(map(str, node))}"[:200])


def _build(tag: str, given: dict[str, Any]) -> Any:
    """One of tyingspec's own result types from its fields, each checked for its type (a
    field of the object's own, say one shadowing a method, is refused)."""
    import numpy as np

    from tyingspec._src.core.adapters import AdapterError, Returned, _adapter_error
    from tyingspec._src.core.findings import Finding
    from tyingspec._src.core.tolerance import PRECISIONS

    def text(x: Any) -> bool:
        return isinstance(x, str)

    def maybe_text(x: Any) -> bool:
        return x is None or isinstance(x, str)

    def maybe_array(x: Any) -> bool:
        return x is None or isinstance(x, np.ndarray)

    checks: dict[str, dict[str, Callable[[Any], bool]]] = {
        "_Shared": {"name": text, "dtype": lambda x: _dtype_of(x) is not None,
                    "shape": lambda x: isinstance(x, tuple) and all(
                        type(s) is int and s >= 0 for s in x)},
        "Finding": {"check": text, "invariant": text, "detail": text, "label": maybe_text,
                    "outcome": lambda x: x in ("passed", "failed", "not_applicable"),
                    "evaluations": lambda x: type(x) is int, "power": lambda x: type(x) is bool},
        "Returned": {"dE": lambda x: isinstance(x, (np.ndarray, _Shared)),
                     "mutated": lambda x: isinstance(x, tuple) and all(map(text, x)),
                     "precision": lambda x: x in PRECISIONS,
                     "loss": lambda x: x is None or type(x) is float,
                     "dW": maybe_array, "db": maybe_array,
                     "evidence": lambda x: isinstance(x, dict),
                     "findings": lambda x: isinstance(x, tuple) and all(
                         type(f) is Finding for f in x)},
        "AdapterError": {"adapter": text, "problem": text, "key": maybe_text,
                         "expected": maybe_text, "got": maybe_text},
    }
    kind: type[Any] = {"_Shared": _Shared, "Finding": Finding, "Returned": Returned,
                       "AdapterError": AdapterError}[tag]
    names = set(_ERROR_FIELDS) if kind is AdapterError else {f.name for f in fields(kind)}
    if set(given) != names:
        raise _Refused(f"a {tag} with fields {sorted(given)}"[:300])
    # a field added since this table was written crosses as plain data, unchecked
    check = {k: ok for k, ok in checks[tag].items() if k in names}
    bad = next((k for k, ok in check.items() if not ok(given[k])), None)
    if bad is not None:
        raise _Refused(f"a {tag} whose {bad} is {_type_name(given[bad])} "
                       f"{repr(given[bad])[:80]}")
    if tag == "AdapterError":
        error: AdapterError = _adapter_error(*(given[k] for k in _ERROR_FIELDS))
        return error
    return kind(**given)


def _loaded_answer(answer: Any) -> Any:
    """``answer`` when it is one the worker gives after loading its target."""
    from tyingspec._src.core.adapters import AdapterError

    if isinstance(answer, tuple) and len(answer) == 4 and answer[0] == "loaded" and \
            (answer[1] is None or isinstance(answer[1], str)) and \
            isinstance(answer[2], list) and all(isinstance(k, str) for k in answer[2]) and \
            _file_digests(answer[3]):
        return answer
    if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "error" and \
            isinstance(answer[1], AdapterError):
        return answer
    raise _Refused(f"an answer to the load of another form: {repr(answer)[:120]}")


def _call_answer(answer: Any) -> Any:
    """``answer`` when it is one the worker gives to a call."""
    from tyingspec._src.core.adapters import AdapterError, Returned

    if isinstance(answer, tuple) and len(answer) == 4 and \
            isinstance(answer[2], set) and all(isinstance(k, str) for k in answer[2]) and \
            _file_digests(answer[3]) and \
            ((answer[0] == "ok" and isinstance(answer[1], Returned)) or
             (answer[0] == "error" and isinstance(answer[1], AdapterError))):
        return answer
    raise _Refused(f"an answer to a call of another form: {repr(answer)[:120]}")


def _file_digests(x: Any) -> bool:
    """Whether ``x`` is what the worker says its code read: paths and their digests."""
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str)
                                       for k, v in x.items())
