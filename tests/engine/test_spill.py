"""An input too large to copy beside the call is handed over itself, its bytes in a temporary
file: a write into it is still reported, and the input is put back, for every adapter form.

``SPILL_ABOVE`` is set to 0 here so that the tiny arrays of these cases take the path the
2.1 GB E of Llama-3's head takes (``core.adapters.Handed``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from tyingspec import KINDS, AdapterError, Case, build, load
from tyingspec._src.core import adapters
from tyingspec._src.core.adapters import Handed, call_kernel, call_model
from tyingspec._src.engine.observe import batch_for, observe
from tyingspec._src.kinds.linear_ce.adapter import call_linear_ce
from tyingspec._src.kinds.linear_ce.kind import standard_ce_cases
from tyingspec._src.kinds.linear_ce.zoo import ce_numpy
from tyingspec._src.kinds.probe.builtins import REGISTRY

MODEL_BATCH = build(Case("a", V=6, d=3, N=5, seed=1, composition="repeats"))
CE_PLAIN = next(c for c in standard_ce_cases(0) if c.name == "ce-plain")


@pytest.fixture
def spill_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "SPILL_ABOVE", 0)


def _model(write: bool, seen: dict[str, Any]) -> Callable[..., Any]:
    def fn(E, W, b, tokens, targets, *, res, s_in):  # type: ignore[no-untyped-def]
        seen["E"] = E
        out = REGISTRY["tied"].model(E, W, b, tokens, targets, res=res, s_in=s_in)
        if write:
            E[2, 1] = -E[2, 1]
        return out
    return fn


def _kernel(write: bool, seen: dict[str, Any]) -> Callable[..., Any]:
    def fn(tokens, dx, h, g, vocab_size):  # type: ignore[no-untyped-def]
        seen["E"] = g  # the largest input of a kernel: [N, V]
        dE = REGISTRY["tied"].kernel(tokens, dx, h, g, vocab_size)
        if write:
            g *= 2.0
        return dE
    return fn


def _ce_numpy(write: bool, seen: dict[str, Any]) -> Callable[..., Any]:
    def fn(h, E, targets, **options):  # type: ignore[no-untyped-def]
        seen["E"] = E
        out = ce_numpy(h, E, targets, **options)
        if write:
            E[0] += 1.0
        return out
    return fn


def _ce_torch(write: bool, seen: dict[str, Any]) -> Any:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class WritesWeight(torch.nn.Module):
        def __init__(self, **options: Any) -> None:
            super().__init__()

        def forward(self, weight: Any, input: Any, target: Any) -> Any:
            seen["E"] = weight.detach().numpy()
            loss = F.cross_entropy(input @ weight.T, target)
            if write:  # where autograd's version counter does not see it
                seen["E"][1] *= -1.0
            return loss
    return WritesWeight


def _inputs(form: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The adapter call of one form and its inputs."""
    if form == "model":
        return call_model, KINDS["model"].inputs(MODEL_BATCH)
    if form == "kernel":
        return call_kernel, KINDS["kernel"].inputs(MODEL_BATCH)
    _, batch = batch_for(load("ce-numpy", "linear-ce"), CE_PLAIN)
    return call_linear_ce, KINDS["linear-ce"].inputs(batch)


FORMS = {"model": _model, "kernel": _kernel, "ce-numpy": _ce_numpy, "ce-torch": _ce_torch}
LARGEST = {"model": "E", "kernel": "g", "ce-numpy": "E", "ce-torch": "E"}


@pytest.mark.usefixtures("spill_everything")
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("write", [False, True], ids=["clean", "writes"])
def test_a_spilled_input_is_the_input_itself_and_a_write_into_it_is_reported_and_undone(
        form: str, write: bool) -> None:
    call, inputs = _inputs(form)
    before = {k: v.copy() for k, v in inputs.items() if isinstance(v, np.ndarray)}
    seen: dict[str, Any] = {}
    out = call(f"user:{form}", FORMS[form](write, seen), inputs)
    key = LARGEST[form]
    # no copy was handed over: the adapter read (and wrote) the caller's own memory
    assert np.shares_memory(seen["E"], inputs[key])
    assert out.mutated == ((key,) if write else ()), out.mutated
    for k, v in before.items():  # and every byte is back
        assert adapters.same_bits(inputs[k], v), k


def test_without_spilling_the_adapter_gets_a_copy() -> None:
    # the other side of the test above: at the default threshold these arrays are copied
    call, inputs = _inputs("model")
    seen: dict[str, Any] = {}
    out = call("user:model", _model(True, seen), inputs)
    assert not np.shares_memory(seen["E"], inputs["E"]) and out.mutated == ("E",)


@pytest.mark.usefixtures("spill_everything")
def test_an_adapter_that_writes_and_then_raises_leaves_its_inputs_as_they_were() -> None:
    call, inputs = _inputs("model")
    E0 = inputs["E"].copy()

    def fn(E, W, b, tokens, targets, *, res, s_in):  # type: ignore[no-untyped-def]
        E[:] = 7.0
        raise RuntimeError("out of memory")

    with pytest.raises(AdapterError, match="RuntimeError: out of memory"):
        call("user:raises", fn, inputs)
    np.testing.assert_array_equal(inputs["E"], E0)


@pytest.mark.usefixtures("spill_everything")
def test_a_write_of_an_equal_value_into_a_spilled_input_is_reported() -> None:
    E = np.zeros((4, 3))
    with Handed({"E": E}) as c:
        c["E"][1] = -0.0
        assert c.mutated() == ("E",)
    assert not np.signbit(E).any()


@pytest.mark.usefixtures("spill_everything")
def test_a_spill_that_cannot_be_written_falls_back_to_a_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Full:
        closed = False

        def write(self, b: Any) -> int:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            self.closed = True

    files: list[Full] = []
    monkeypatch.setattr(adapters.tempfile, "TemporaryFile",
                        lambda **k: files.append(Full()) or files[-1])
    E = np.arange(12.0).reshape(4, 3)
    with Handed({"E": E}) as c:
        assert c["E"] is not E and not c.spilled
        c["E"][0, 0] = 5.0
        assert c.mutated() == ("E",)
    assert E[0, 0] == 0.0 and files and all(f.closed for f in files)


@pytest.mark.usefixtures("spill_everything")
def test_a_spill_file_that_cannot_be_made_falls_back_to_a_copy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # a TMPDIR that is not there (or not writable): the file cannot even be created
    monkeypatch.setattr(adapters.tempfile, "tempdir", str(tmp_path / "gone"))
    E = np.arange(12.0).reshape(4, 3)
    with Handed({"E": E}) as c:
        assert c["E"] is not E and not c.spilled
        c["E"][0, 0] = 5.0
        assert c.mutated() == ("E",)
    assert E[0, 0] == 0.0


@pytest.mark.usefixtures("spill_everything")
def test_what_was_written_is_kept_only_for_a_result_that_is_a_view_of_it() -> None:
    # the kept copy is the size of the input (2.1 GB at Llama-3's head): made only when a
    # returned array is a view of the input written into, which unaliased() then reads
    shapes: dict[str, Callable[[np.ndarray], Any]] = {
        "an array": lambda view: np.zeros(3),
        "a dict of arrays": lambda view: {"dE": np.zeros(3), "loss": 1.0},
        "nothing": lambda view: None,
        "the view": lambda view: view,
        "a dict holding the view": lambda view: {"dE": view, "loss": 1.0},
        "a read-only mapping holding the view": lambda view: MappingProxyType({"dE": view})}
    for what, shape in shapes.items():
        kept = "view" in what
        E = np.ones((4, 3))
        with Handed({"E": E}) as c:
            c["E"][1] = 2.0
            out = shape(c["E"][1:3])
            assert c.mutated(out) == ("E",)
            assert ("E" in c.written) is kept, what
            if kept:
                got = c.unaliased(out)
                got = got["dE"] if isinstance(got, Mapping) else got
                np.testing.assert_array_equal(got, [[2.0] * 3, [1.0] * 3])
        assert (E == 1.0).all()


@pytest.mark.usefixtures("spill_everything")
def test_a_spill_file_is_closed_whether_or_not_it_was_compared() -> None:
    E = np.ones((4, 3))
    with Handed({"E": E}) as c:
        (f,) = c.spilled.values()
    assert f.closed and not c.spilled
    with pytest.raises(ZeroDivisionError), Handed({"E": E}) as c:
        (f,) = c.spilled.values()
        c["E"][3] = 2.0
        raise ZeroDivisionError
    assert f.closed and (E == 1.0).all()  # put back on the way out of the exception


@pytest.mark.usefixtures("spill_everything")
def test_the_engine_verdict_of_a_spilled_mutation_is_the_copied_one() -> None:
    case = Case("a", V=40, d=8, N=24, seed=4, composition="repeats")
    mutant = load("sorts-tokens-in-place", "model")
    assert observe(mutant, case).label == "inputs_mutated"
    # and the batch it was judged on was put back: the same verdict again
    assert observe(mutant, case).label == "inputs_mutated"
    assert observe(load("tied", "model"), case).label == "correct"


@pytest.mark.parametrize("form", ["model", "kernel", "ce-numpy"])
def test_a_gradient_returned_in_the_inputs_own_buffer_is_what_the_adapter_wrote(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # an adapter that builds its result in its largest input's memory and returns that view
    # gets, spilled, exactly what it got with a copy (the input itself is put back)
    def in_place(seen: dict[str, Any]) -> Callable[..., Any]:
        inner = FORMS[form](False, seen)

        @functools.wraps(inner)  # its signature: the linear-ce form reads it
        def fn(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            buf = seen["E"]
            if form == "kernel":
                buf.reshape(-1)[:out.size] = out.reshape(-1)
                return buf.reshape(-1)[:out.size].reshape(out.shape)
            buf[...] = out["dE"]
            return dict(out, dE=buf)
        return fn

    results = []
    for spill in (False, True):
        if spill:
            monkeypatch.setattr(adapters, "SPILL_ABOVE", 0)
        call, inputs = _inputs(form)
        before = inputs[LARGEST[form]].copy()
        results.append(call(f"user:{form}", in_place({}), inputs))
        assert adapters.same_bits(inputs[LARGEST[form]], before)
    copied, spilled = results
    assert spilled.mutated == copied.mutated == (LARGEST[form],)
    assert adapters.same_bits(np.asarray(spilled.dE), np.asarray(copied.dE))
