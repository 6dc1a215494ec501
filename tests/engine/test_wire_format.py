"""The wire format (``engine.isolation.wire``) in-process, with no worker started: what the
worker encodes the parent decodes to an equal value of the same type, arrays bit for bit, the
frame is laid out as documented, and a frame cut anywhere is refused, never a traceback.

(``tests/engine/test_isolation_safety.py`` holds the frames a hostile worker would send; these
are the frames a worker of tyingspec's sends.)
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tyingspec._src.core.adapters import AdapterError, Returned
from tyingspec._src.core.findings import Finding
from tyingspec._src.engine.isolation import wire
from tyingspec._src.engine.isolation.wire import (
    _HEAD,
    _MAGIC,
    _call_answer,
    _decode,
    _encode,
    _loaded_answer,
    _Refused,
    _Shared,
    _Unsendable,
)


def _round_trip(x: Any) -> Any:
    return _decode(_encode(x))


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_a_frame_is_the_magic_the_tree_length_the_tree_and_the_arrays_raw_bytes() -> None:
    a = np.arange(6, dtype="<i4").reshape(2, 3)
    b = np.array([1.5, -2.0], dtype="<f8")
    frame = _encode(("ok", a, {"b": b}))
    assert frame.startswith(_MAGIC)
    (n,) = _HEAD.unpack_from(frame, len(_MAGIC))
    start = len(_MAGIC) + _HEAD.size
    tree = json.loads(frame[start:start + n])
    body = frame[start + n:]
    assert body == a.tobytes() + b.tobytes()  # in the order met, nothing else after the tree
    first, second = tree["items"][1], tree["items"][2]["items"][0][1]
    assert first == {"$": "array", "dtype": "<i4", "shape": [2, 3], "at": 0}
    assert second == {"$": "array", "dtype": "<f8", "shape": [2], "at": a.nbytes}


@pytest.mark.parametrize("dtype", ["<f4", "<f8", ">f4", "<f2", "<i1", "<i8", "<u2", "|u1",
                                   "|b1", "<c8", "<c16"])
@pytest.mark.parametrize("layout", ["c", "fortran", "strided", "empty", "scalar-0d"])
def test_an_array_comes_back_bit_for_bit_writable_and_its_own(dtype: str, layout: str) -> None:
    rng = np.random.default_rng(7)
    base = (rng.standard_normal((4, 6)) * 50).astype(dtype)
    a = {"c": base, "fortran": np.asfortranarray(base), "strided": base[::2, ::3],
         "empty": base[:0], "scalar-0d": np.array(base[1, 2])}[layout]
    frame = _encode(a)
    back = _decode(frame)
    assert isinstance(back, np.ndarray)
    assert back.dtype == a.dtype and back.shape == a.shape
    assert _bits(back) == _bits(a)
    assert back.flags.writeable and back.flags.c_contiguous
    # a copy of the frame's bytes, not a view of them: the frame can go
    assert back.base is None or not isinstance(back.base, (bytes, memoryview))
    if back.size:
        back.reshape(-1)[0] = back.reshape(-1)[-1]  # writable in place
        assert _decode(frame).tobytes() == _bits(a)  # and the frame is untouched


def test_a_nan_payload_and_signed_zero_cross_bit_for_bit() -> None:
    a = np.array([0.0, -0.0, np.inf, -np.inf], dtype="<f8")
    weird = np.frombuffer(np.array([0x7FF8_0000_0000_0001], dtype="<u8").tobytes(), "<f8")
    a = np.concatenate([a, weird])
    assert _round_trip(a).tobytes() == a.tobytes()
    assert math.copysign(1.0, _round_trip(-0.0)) == -1.0


def test_a_numpy_scalar_comes_back_a_numpy_scalar_of_its_dtype() -> None:
    for x in (np.float32(1.25), np.int64(-3), np.float16(0.5), np.bool_(True), np.uint8(200)):
        back = _round_trip(x)
        assert type(back) is type(x) and back.dtype == x.dtype and back == x


def test_bfloat16_crosses_by_name() -> None:
    from tyingspec._src.core.tolerance import numpy_dtype

    bf16 = numpy_dtype("bfloat16")
    a = np.array([1.0, -2.5, 3e38], dtype=np.float32).astype(bf16)
    frame = _encode(a)
    assert b'"dtype":"bfloat16"' in frame
    back = _decode(frame)
    assert back.dtype == bf16 and back.tobytes() == a.tobytes()


def test_containers_keep_their_type_and_python_numbers_theirs() -> None:
    value = {"t": (1, 2.0, "x"), "l": [True, 1, 1.0, None], "s": {3, 4}, "f": frozenset({"a"}),
             7: "an int key", (1, "k"): "a tuple key", "big": 2 ** 80, "inf": float("-inf")}
    back = _round_trip(value)
    assert back == value
    assert type(back["t"]) is tuple and type(back["l"]) is list
    assert type(back["s"]) is set and type(back["f"]) is frozenset
    assert [type(v) for v in back["l"]] == [bool, int, float, type(None)]
    assert (1, "k") in back and 7 in back


def test_the_result_types_cross_as_their_fields() -> None:
    finding = Finding("check", "invariant", "failed", "detail", "input_path_missing", 3, True)
    returned = Returned(dE=_Shared("tyingspec_ab", (5, 3), "<f4"), mutated=("E",),
                        precision="float32", loss=0.25, dW=np.eye(2), db=None,
                        evidence={"tie": {"vocab": 5}}, findings=(finding,))
    error = AdapterError("mod:fn", "raised an exception", key="dE", expected="an array",
                         got="None")
    back_r, back_e = _round_trip((returned, error))
    assert type(back_r) is Returned and type(back_r.dE) is _Shared
    assert back_r.dE == returned.dE and back_r.findings == (finding,)
    assert back_r.mutated == ("E",) and back_r.loss == 0.25 and back_r.db is None
    assert np.array_equal(back_r.dW, np.eye(2)) and back_r.evidence == {"tie": {"vocab": 5}}
    assert isinstance(back_e, AdapterError)
    assert (back_e.adapter, back_e.problem, back_e.key, back_e.expected, back_e.got) == \
        ("mod:fn", "raised an exception", "dE", "an array", "None")


def test_the_answers_a_worker_gives_are_of_the_forms_the_parent_takes() -> None:
    loaded = ("loaded", None, ["kernel"], {"/src/helper.py": "0f1e"})
    failed = ("error", AdapterError("m:f", "import raised", got="ImportError: x"))
    assert _loaded_answer(_round_trip(loaded)) == loaded
    assert _loaded_answer(_round_trip(failed))[0] == "error"
    returned = Returned(dE=np.zeros((2, 2)), mutated=(), precision="float64")
    call = ("ok", returned, {"psm_1"}, {"/src/a.py": "ab"})
    back = _call_answer(_round_trip(call))
    assert back[0] == "ok" and back[2] == {"psm_1"} and back[3] == {"/src/a.py": "ab"}
    with pytest.raises(_Refused, match="call of another form"):
        _call_answer(_round_trip(("ok", returned, ["psm_1"], {})))  # a list, not a set
    with pytest.raises(_Refused, match="load of another form"):
        _loaded_answer(_round_trip(("loaded", None, "kernel", {})))


def test_a_value_nested_past_the_limit_is_unsendable() -> None:
    deep: Any = []
    for _ in range(wire._MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(_Unsendable, match="nested too deeply"):
        _encode(deep)
    shallow: Any = []
    for _ in range(wire._MAX_DEPTH - 1):
        shallow = [shallow]
    assert _round_trip(shallow) == shallow


def test_a_frame_cut_anywhere_is_refused_not_a_traceback() -> None:
    frame = _encode(("ok", np.arange(12.0).reshape(3, 4), {"k": (1, "two")}))
    assert _decode(frame)[2] == {"k": (1, "two")}
    for cut in range(len(frame)):
        with pytest.raises(_Refused):
            _decode(frame[:cut])


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=60, deadline=None)
@given(_PLAIN)
def test_any_plain_value_round_trips_equal_and_of_its_type(value: Any) -> None:
    back = _round_trip(value)
    assert back == value and type(back) is type(value)
    assert _encode(back) == _encode(value)  # and encodes to the same frame again
