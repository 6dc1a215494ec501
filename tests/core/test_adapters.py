"""Adapter errors name the adapter, the key, what was expected and what came back."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from tyingspec import KINDS, AdapterError, Case, build, load, resolve
from tyingspec._src.core.adapters import call_kernel, call_model
from tyingspec._src.engine.isolation import SHARE_ABOVE

B = build(Case("a", V=6, d=3, N=5, seed=1, composition="repeats"))
INPUTS = KINDS["model"].inputs(B)


def _good(E, W, b, tokens, targets, *, res, s_in):  # type: ignore[no-untyped-def]
    from tyingspec._src.kinds.probe.builtins import REGISTRY

    return REGISTRY["tied"].model(E, W, b, tokens, targets, res=res, s_in=s_in)


def _call(fn) -> object:  # type: ignore[no-untyped-def]
    return call_model("user:f", fn, INPUTS)


def _with(**changes):  # type: ignore[no-untyped-def]
    def fn(*a, **k):  # type: ignore[no-untyped-def]
        out = dict(_good(*a, **k))
        out.update(changes)
        return out
    return fn


@pytest.mark.parametrize("fn,words", [
    (_with(dE=np.zeros((3, 6))), ["'dE'", "wrong shape", "(6, 3)", "(3, 6)"]),
    (_with(dE=np.full((6, 3), np.nan)), ["'dE'", "non-finite", "18 NaN/inf"]),
    (_with(dW=np.zeros((3, 3), dtype=np.int64)), ["'dW'", "dtype", "int64"]),
    (_with(db=None), ["'db'", "missing value"]),
    (_with(loss=np.ones(3)), ["'loss'", "scalar"]),
    (lambda *a, **k: [1, 2], ["non-mapping", "list"]),
    (lambda *a, **k: {"loss": 1.0}, ["missing key", "'dE'"]),
    (lambda *a, **k: 1 / 0, ["raised", "ZeroDivisionError"]),
], ids=["shape", "nan", "dtype", "db-none", "loss-shape", "not-mapping", "missing-key", "raises"])
def test_bad_output_gives_a_specific_error(fn, words: list[str]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AdapterError) as info:
        _call(fn)
    msg = str(info.value)
    assert msg.startswith("adapter 'user:f':")
    for w in words:
        assert w in msg, msg


def test_torch_like_tensors_are_converted() -> None:
    class FakeTensor:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def detach(self) -> FakeTensor:
            return self

        def cpu(self) -> FakeTensor:
            return self

        def numpy(self) -> np.ndarray:
            return self.a

    def fn(*a, **k):  # type: ignore[no-untyped-def]
        return {k2: (FakeTensor(np.asarray(v)) if v is not None else None)
                for k2, v in _good(*a, **k).items()}

    out = _call(fn)
    assert out.dE.shape == (6, 3)  # type: ignore[attr-defined]


def test_mutating_adapter_is_reported_and_callers_arrays_stay_untouched() -> None:
    E0 = B.E.copy()

    def fn(E, W, b, tokens, targets, *, res, s_in):  # type: ignore[no-untyped-def]
        out = _good(E, W, b, tokens, targets, res=res, s_in=s_in)
        E *= 2.0
        tokens[:] = 0
        return out

    out = _call(fn)
    assert out.mutated == ("E", "tokens")  # type: ignore[attr-defined]
    np.testing.assert_array_equal(B.E, E0)


WRITERS = """
from tyingspec._src.kinds.probe.builtins import REGISTRY

def _good(E, W, b, tokens, targets, *, res, s_in):
    return REGISTRY["tied"].model(E, W, b, tokens, targets, res=res, s_in=s_in)

def clean(E, W, b, tokens, targets, *, res, s_in):
    return _good(E, W, b, tokens, targets, res=res, s_in=s_in)

def writes_E(E, W, b, tokens, targets, *, res, s_in):
    out = _good(E, W, b, tokens, targets, res=res, s_in=s_in)
    E[3, 1] = -E[3, 1]
    return out

def writes_E_and_tokens(E, W, b, tokens, targets, *, res, s_in):
    out = _good(E, W, b, tokens, targets, res=res, s_in=s_in)
    E *= 2.0
    tokens[:] = 0
    return out

def hangs(E, W, b, tokens, targets, *, res, s_in):
    import time
    time.sleep(3600)

def segfaults(E, W, b, tokens, targets, *, res, s_in):
    import ctypes
    ctypes.string_at(0)

def writes_minus_zero_over_zero(E, W, b, tokens, targets, *, res, s_in):
    out = _good(E, W, b, tokens, targets, res=res, s_in=s_in)
    E[E == 0.0] = -0.0  # equal in value, other bits: still a write
    return out

def in_bfloat16(E, W, b, tokens, targets, *, res, s_in):
    from tyingspec._src.core.tolerance import numpy_dtype
    out = dict(_good(E, W, b, tokens, targets, res=res, s_in=s_in))
    out["dE"] = out["dE"].astype(numpy_dtype("bfloat16"))
    return out
"""


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr,mutated", [
    ("clean", ()), ("writes_E", ("E",)), ("writes_E_and_tokens", ("E", "tokens"))])
def test_a_worker_target_writing_into_a_shared_input_is_reported_and_the_callers_arrays_stay(
        tmp_path, attr: str, mutated: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    from tyingspec._src.engine.observe import call, observe

    (tmp_path / "writers.py").write_text(WRITERS)
    case = Case("big", V=1024, d=256, N=16, seed=3)
    batch = build(case)
    # E goes through shared memory (the worker hands it over uncopied), tokens is pickled
    assert batch.E.nbytes >= SHARE_ABOVE > batch.tokens.nbytes
    E0, tokens0 = batch.E.copy(), batch.tokens.copy()
    target = load(f"writers:{attr}", "model", paths=(str(tmp_path),))
    try:
        assert target.worker is not None
        assert call(target, batch).mutated == mutated
        np.testing.assert_array_equal(batch.E, E0)
        np.testing.assert_array_equal(batch.tokens, tokens0)
        # again, on the blocks written afresh: the same answer
        assert call(target, batch).mutated == mutated
        obs = observe(target, case)
        assert obs.label == ("correct" if not mutated else "inputs_mutated"), obs.label
    finally:
        target.close()


def test_a_write_of_equal_value_into_a_shared_input_is_reported(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tyingspec._src.engine.observe import call

    (tmp_path / "writers.py").write_text(WRITERS)
    batch = build(Case("big", V=1024, d=256, N=16, seed=3))
    batch.E[5, :] = 0.0  # the target writes -0.0 over these: a comparison by value sees nothing
    target = load("writers:writes_minus_zero_over_zero", "model", paths=(str(tmp_path),))
    try:
        assert call(target, batch).mutated == ("E",)
        assert not np.signbit(batch.E[5]).any()
    finally:
        target.close()


KEEPERS = """
from tyingspec._src.kinds.probe.implementations import untied_forward_backward

_kept = {}

def _with_head(E, U, W, b, tokens, targets, res, s_in):
    out = untied_forward_backward(E, U, W, b, tokens, targets, res=res, s_in=s_in)
    return {"loss": out["loss"], "dE": out["dE"] + out["dU"], "dW": out["dW"], "db": out["db"]}

def keeps_E(E, W, b, tokens, targets, *, res, s_in):
    # the head is the E of the first call, kept without a copy: a stale tie after a step
    U = _kept.setdefault("E", E)
    return _with_head(E, U, W, b, tokens, targets, res, s_in)

def keeps_a_slice_of_E(E, W, b, tokens, targets, *, res, s_in):
    U = _kept.setdefault("slice", E[:, :])  # a view of the view: it keeps E's view alive
    return _with_head(E, U, W, b, tokens, targets, res, s_in)
"""


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr", ["keeps_E", "keeps_a_slice_of_E"])
def test_an_input_the_worker_target_keeps_stays_its_own_copy_as_in_process(
        tmp_path, monkeypatch, attr: str) -> None:  # type: ignore[no-untyped-def]
    import uuid

    from tyingspec._src.engine.observe import observe

    module = f"keepers_{uuid.uuid4().hex}"  # in-process state of its own
    (tmp_path / f"{module}.py").write_text(KEEPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    case = Case("big", V=1024, d=256, N=16, seed=3)
    assert build(case).E.nbytes >= SHARE_ABOVE
    labels = []
    for isolate in (False, True):
        target = load(f"{module}:{attr}", "model", isolate=isolate, paths=(str(tmp_path),))
        try:
            assert (target.worker is not None) == isolate
            obs = observe(target, case)
            assert obs.diagnosis.wrong, obs.label  # the kept head is stale after the step
            labels.append(obs.label)
            obs = observe(target, case)  # again: its kept head is still the first call's E
            labels.append(obs.label)
        finally:
            target.close()
    assert labels[:2] == labels[2:], labels


def _exists(name: str) -> bool:
    from multiprocessing import shared_memory

    try:
        shared_memory.SharedMemory(name=name).close()
    except FileNotFoundError:
        return False
    return True


def test_a_large_dE_comes_back_bit_for_bit_and_its_block_is_gone(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "writers.py").write_text(WRITERS)
    batch = build(Case("big", V=1024, d=256, N=16, seed=3))
    inputs = KINDS["model"].inputs(batch)
    here = call_model("writers:clean", _good, inputs)
    target = load("writers:clean", "model", paths=(str(tmp_path),))
    try:
        worker = target.worker
        assert worker is not None
        got = []
        for _ in range(2):
            worker.submit(inputs)
            name = worker._result
            assert name is not None
            got.append(worker.collect().dE)
            assert got[-1].nbytes >= SHARE_ABOVE and not _exists(name)
        # a new block each call: the first dE is left as it was
        assert not np.shares_memory(*got)
        assert got[0].tobytes() == got[1].tobytes() == here.dE.tobytes()
    finally:
        target.close()


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _result_fds(pid: int) -> set[str]:
    """The result blocks (by name) the process ``pid`` holds open."""
    import os

    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "/tyingspec_" in link:
            names.add(link.split("/")[-1].split()[0])
    return names


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.skipif(sys.platform != "linux", reason="reads the worker's /proc/PID/fd")
def test_a_result_block_whose_dE_has_gone_takes_a_later_dE_and_never_a_live_one(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gc

    import tyingspec._src.engine.isolation as iso

    (tmp_path / "writers.py").write_text(WRITERS)
    batches = [KINDS["model"].inputs(build(Case("big", V=1024, d=256, N=16, seed=s)))
               for s in (3, 4, 5)]
    want = [call_model("writers:clean", _good, b).dE.tobytes() for b in batches]
    target = load("writers:clean", "model", paths=(str(tmp_path),))
    try:
        worker = target.worker
        assert worker is not None and worker._proc is not None
        first = worker.invoke(batches[0]).dE
        at, name = _address(first), next(iter(_result_fds(worker._proc.pid)))
        del first
        gc.collect()
        assert list(worker._results) == [name]  # its dE gone: offered for the next result
        second = worker.invoke(batches[1]).dE  # written over in place, the same mapping here
        assert _address(second) == at and second.tobytes() == want[1]
        assert worker._results == {}
        third = worker.invoke(batches[2]).dE  # the second is alive: a new block
        assert _address(third) != at and third.tobytes() == want[2]
        assert second.tobytes() == want[1]
        # kept within RESULTS_KEPT: beyond it the oldest are let go, and the worker closes them
        names = _result_fds(worker._proc.pid)
        assert len(names) == 2
        del second, third
        gc.collect()
        assert len(worker._results) == 2
        monkeypatch.setattr(iso, "RESULTS_KEPT", 0)
        fourth = worker.invoke(batches[0]).dE
        assert worker._results == {}  # none kept, none offered: the answer in a new block
        assert _result_fds(worker._proc.pid).isdisjoint(names)
        assert fourth.tobytes() == want[0]
        # and one whose dE goes now is not kept at all
        names = _result_fds(worker._proc.pid)
        del fourth
        gc.collect()
        assert worker._results == {} and len(worker._dropped) == 1
        worker.submit(batches[0])
        made = worker._result
        alive = worker.collect().dE
        # nor is a new one kept open in the worker, even while its dE lives here (it closes
        # one after sending it, so by its next answer at the latest)
        worker.invoke(batches[1])
        assert made is not None and made not in _result_fds(worker._proc.pid)
        assert alive.tobytes() == want[0]
        del alive
        # a worker started again holds none of the old blocks: none is offered to it
        kept = worker.invoke(batches[0]).dE
        worker.stop()
        del kept
        gc.collect()
        assert worker._results == {}
    finally:
        target.close()


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr,label", [("clean", "correct"), ("writes_E", "inputs_mutated")])
def test_a_first_call_prepared_while_the_worker_loads_is_sent_the_blocks_written_then(
        tmp_path, monkeypatch, attr: str, label: str) -> None:  # type: ignore[no-untyped-def]
    import tyingspec._src.engine.isolation as iso
    from tyingspec._src.engine import observe as ob

    (tmp_path / "writers.py").write_text(WRITERS)
    case = Case("big", V=1024, d=256, N=16, seed=3)
    assert build(case).E.nbytes >= SHARE_ABOVE
    writes: list[int] = []
    written = iso.Worker._written

    def counted(self: iso.Worker, inputs):  # type: ignore[no-untyped-def]
        writes.append(len(inputs))
        return written(self, inputs)

    monkeypatch.setattr(iso.Worker, "_written", counted)
    target = ob.load(f"writers:{attr}", "model", paths=(str(tmp_path),), prepare=[case])
    try:
        assert len(writes) == 1  # written while the worker imported its target
        # the first call goes out on those blocks, and a write into them is still seen
        assert ob.observe(target, case, step=False).label == label
        assert len(writes) == 1
        assert ob.observe(target, case, step=False).label == label
        assert len(writes) == 2  # a later call writes its own
    finally:
        target.close()


def test_inputs_written_ahead_are_sent_only_for_the_same_arrays(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "writers.py").write_text(WRITERS)
    staged = KINDS["model"].inputs(build(Case("big", V=1024, d=256, N=16, seed=3)))
    other = KINDS["model"].inputs(build(Case("big", V=1024, d=256, N=16, seed=4)))
    target = load("writers:clean", "model", paths=(str(tmp_path),))
    try:
        worker = target.worker
        assert worker is not None
        for sent, staged_too in ((other, staged), (dict(staged), staged)):
            worker.stage(staged_too)
            worker.submit(sent)  # another batch: written afresh; the same arrays: as staged
            got = worker.collect()
            assert got.dE.tobytes() == call_model("writers:clean", _good, sent).dE.tobytes()
            assert got.mutated == ()
    finally:
        target.close()


@pytest.mark.slow
@pytest.mark.moved
def test_a_large_bfloat16_dE_comes_back_as_bfloat16_bit_for_bit(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tyingspec._src.core.tolerance import numpy_dtype

    (tmp_path / "writers.py").write_text(WRITERS)
    batch = build(Case("big", V=1024, d=512, N=16, seed=3))
    inputs = KINDS["model"].inputs(batch)
    here = call_model("writers:clean", _good, inputs).dE.astype(numpy_dtype("bfloat16"))
    target = load("writers:in_bfloat16", "model", paths=(str(tmp_path),))
    try:
        assert target.worker is not None
        got = target.worker.invoke(inputs)
        # through shared memory, not as the void dtype its .str names ('<V2')
        assert got.dE.nbytes >= SHARE_ABOVE
        assert got.dE.dtype == numpy_dtype("bfloat16") and got.precision == "bfloat16"
        assert got.dE.tobytes() == here.tobytes()
    finally:
        target.close()


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr", ["hangs", "segfaults"])
def test_a_worker_that_dies_in_a_large_call_leaves_no_shared_memory(
        tmp_path, attr: str) -> None:  # type: ignore[no-untyped-def]
    from multiprocessing import shared_memory

    (tmp_path / "writers.py").write_text(WRITERS)
    batch = build(Case("big", V=1024, d=256, N=16, seed=3))
    target = load(f"writers:{attr}", "model", paths=(str(tmp_path),), timeout=2)
    try:
        worker = target.worker
        assert worker is not None
        worker.submit(KINDS["model"].inputs(batch))
        pool = [b.name for b in worker._pool]
        result = worker._result
        assert pool and result is not None
        # as if the worker had made its result block just before it died: the name is the
        # parent's, so the parent unlinks it once the worker is gone
        shared_memory.SharedMemory(name=result, create=True, size=1 << 20).close()
        with pytest.raises(AdapterError, match="timed out|SIGSEGV"):
            worker.collect()
        assert not _exists(result)
        assert not any(_exists(name) for name in pool)
    finally:
        target.close()


def test_a_finite_array_whose_float32_sum_overflows_passes_validation() -> None:
    from tyingspec._src.core.adapters import validate_array

    a = np.full((4, 3), 3e38, dtype=np.float32)
    a[1, 2] = -1.0
    with np.errstate(over="ignore"):
        assert np.isinf(a.sum())  # the premise: the sum alone would call it non-finite
    assert validate_array("user:f", "dE", a, (4, 3)) is a


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("where", [(0, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_anywhere_is_reported_with_its_count_and_first_place(
        dtype: str, where: tuple[int, int], bad: float) -> None:
    from tyingspec._src.core.adapters import validate_array
    from tyingspec._src.core.tolerance import numpy_dtype

    a = np.ones((5, 3), dtype=numpy_dtype(dtype))  # type: ignore[arg-type]
    a[where] = bad
    with pytest.raises(AdapterError) as info:
        validate_array("user:f", "dE", a, (5, 3))
    assert str(info.value) == ("adapter 'user:f': key 'dE': non-finite values; expected "
                               f"finite floats, got 1 NaN/inf entries, first at {where}")


def test_an_inf_and_a_minus_inf_are_both_counted() -> None:
    from tyingspec._src.core.adapters import validate_array

    a = np.zeros((2, 3), dtype=np.float32)
    a[1, 0], a[0, 2] = np.inf, -np.inf  # their sum is NaN, not inf: still caught
    with pytest.raises(AdapterError, match=r"got 2 NaN/inf entries, first at \(0, 2\)$"):
        validate_array("user:f", "dE", a, (2, 3))


def test_kernel_adapter_wrong_shape_names_the_kernel_contract() -> None:
    with pytest.raises(AdapterError, match=r"key 'dE': wrong shape; expected shape \(6, 3\)"):
        call_kernel("k:f", lambda t, dx, h, g, V: np.zeros((V, 2)),
                    {"tokens": B.tokens, "dx": np.zeros((5, 3)), "h": np.zeros((5, 3)),
                     "g": np.zeros((5, 6)), "vocab_size": 6})


def test_a_kernel_adapter_checked_as_a_model_is_told_which_kind_it_looks_like(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "kind_probe.py").write_text("def combine(tokens, dx, h, g, vocab_size):\n"
                                            "    return g.T @ h\n")
    with pytest.raises(AdapterError) as info:
        load("kind_probe:combine", "model", paths=(str(tmp_path),))
    msg = str(info.value)
    assert "does not match the model contract" in msg and "--kind kernel" in msg, msg
    assert "f(E, W, b, tokens, targets, *, res, s_in[, padding_idx])" in msg, msg


def test_resolving_a_user_adapter_does_not_load_the_mutant_zoo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "user_adapter.py").write_text("def f(E, W, b, tokens, targets, *, res, s_in):\n"
                                              "    return {}\n")
    code = ("import sys; from tyingspec import load; load('user_adapter:f', 'model'); "
            "print('tyingspec._src.kinds.probe.mutants' in sys.modules, "
            "'tyingspec._src.kinds.probe.implementations' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(tmp_path)})
    assert out.stdout.split() == ["False", "False"], out


def test_unimportable_and_missing_attributes_and_unknown_builtins_are_adapter_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AdapterError, match="cannot be imported.*ModuleNotFoundError"):
        resolve("no_such_module_xyz:f", "model")
    mod = types.ModuleType("tyingspec_test_mod")
    mod.value = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "tyingspec_test_mod", mod)
    with pytest.raises(AdapterError, match="no attribute 'f'"):
        resolve("tyingspec_test_mod:f", "model")
    with pytest.raises(AdapterError, match="not callable"):
        resolve("tyingspec_test_mod:value", "model")
    with pytest.raises(AdapterError, match="known|built-in name"):
        resolve("no-such-builtin", "model")
    with pytest.raises(AdapterError, match="no kernel form"):
        resolve("untied-sum", "kernel")
