"""Adapter errors name the adapter, the key, what was expected and what came back."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from tyingspec import KINDS, AdapterError, Case, build, load, resolve
from tyingspec._adapters import call_kernel, call_model

B = build(Case("a", V=6, d=3, N=5, seed=1, composition="repeats"))
INPUTS = KINDS["model"].inputs(B)


def _good(E, W, b, tokens, targets, *, res, s_in):  # type: ignore[no-untyped-def]
    from tyingspec._implementations import REGISTRY

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
            "print('tyingspec._mutants' in sys.modules, 'tyingspec._implementations' in "
            "sys.modules)")
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
