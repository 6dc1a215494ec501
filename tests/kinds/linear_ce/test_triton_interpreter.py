"""Triton kernels on the CPU: the interpreter switched on before a target's import, and the
gaps of triton's interpreter that ``kinds.linear_ce.interpreter`` fills, pinned against the
installed triton (3.9.0 beside the pinned torch, from the dev extra; 3.8.0, which torch 2.14.1
brings).

Each fill is checked twice: the gap is there without it (so a triton release that closes it
shows here, and the fill can go), and with it the kernel computes what torch does.  What
cannot be filled (inline assembly, a libdevice function outside the table) is exit 2 naming
the triton version and the construct.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tyingspec._src.kinds.linear_ce import interpreter

TARGETS = Path(__file__).parents[2] / "triton_targets"

# torch's tests run again on the newest torch (.ci/run), whose wheel brings its own triton
# (2.14.1: triton 3.8.0): so each supported release is pinned in CI, 3.9.0 by the `triton` extra
pytestmark = pytest.mark.torch


def needs_triton() -> None:
    """Skip without triton, except in CI, which installs it (``.ci/run``: the dev extra) and
    must not pass by skipping."""
    if importlib.util.find_spec("triton") is not None:
        return
    if os.environ.get("CI"):
        pytest.fail("triton is not installed; CI installs it with pip install -e '.[dev]' "
                    "(.ci/run), and these tests must run there")
    pytest.skip("triton is not installed (pip install -e '.[triton]')")


def run_python(code: str) -> dict[str, object]:
    """``code`` in a fresh interpreter with TRITON_INTERPRET=1 (set before triton's import, as
    the worker sets it); its last line of output, as JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


KERNEL = '''
import json
import torch, triton, triton.language as tl
from triton.language.extra.libdevice import tanh          # the dispatching stub
from triton.language.extra.cuda import libdevice as cuda  # the backend's module
from tyingspec._src.kinds.linear_ce import interpreter

cast = tl.cast  # a module's own name for a builtin, as Unsloth's `triton_cast = tl.cast`

@triton.jit
def softcapped(X, Y, softcap, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    c = softcap.to(tl.float32)                  # a Python float argument, as Liger's
    mask = offsets < cast(n, tl.int64)
    x = tl.load(X + offsets, mask=mask)
    y = c * tanh(x / c) + cuda.log1p(x * x)     # libdevice both ways
    tl.store(Y + offsets, y, mask=mask)

def launch(dtype):
    x = torch.linspace(-3, 3, 37, dtype=dtype)
    y = torch.empty_like(x)
    softcapped[(1,)](x, y, 2.0, 37, BLOCK=64)
    want = 2.0 * torch.tanh(x / 2.0) + torch.log1p(x * x)
    return float((y - want).abs().max() / want.abs().max())

try:
    launch(torch.float32)
    before = "ran"
except Exception as exc:
    before = str(exc.__cause__ or exc)
filled = interpreter.install()
print(json.dumps({"before": before, "filled": filled, "version": triton.__version__,
                  "float32": launch(torch.float32), "float64": launch(torch.float64),
                  "blocks": interpreter.BLOCKS}))
'''


def test_the_fills_close_the_gaps_of_the_installed_triton() -> None:
    needs_triton()
    got = run_python(KERNEL)
    assert got["version"] in interpreter.SUPPORTED, (
        f"triton {got['version']} is installed; the fills are pinned on "
        f"{interpreter.SUPPORTED}: run these tests on it and add it")
    # the gap is there without the fill: a float argument has no .to()
    assert "object has no attribute 'to'" in str(got["before"]), got["before"]
    filled = got["filled"]
    assert isinstance(filled, list) and len(filled) == 3
    assert "fp32 scalar" in filled[0] and "libdevice" in filled[1]
    assert "own name for a triton.language builtin" in filled[2]
    # the arithmetic is the kernel's: fp32 within a few fp32 roundings, fp64 within fp64's
    assert float(got["float32"]) < 4e-7  # type: ignore[arg-type]
    assert float(got["float64"]) < 1e-15  # type: ignore[arg-type]
    assert got["blocks"] == {"softcapped": {"BLOCK": 64}}


SYMBOLS = '''
import json
import numpy as np
import triton.language as tl
from triton.runtime import interpreter as interp
from tyingspec._src.kinds.linear_ce import interpreter

try:
    interp.interpreter_builder.create_extern_elementwise("", "", "__nv_tanhf", [], tl.float32,
                                                         True)
    before = "implemented"
except NotImplementedError as exc:
    before = str(exc)
interpreter.install()
errors = {}
for name, (fn, arity) in interpreter.LIBDEVICE.items():
    for symbol, dtype, ty in ((f"__nv_{name}f", np.float32, tl.float32),
                              (f"__nv_{name}", np.float64, tl.float64),
                              (f"__ocml_{name}_f32", np.float32, tl.float32)):
        args = [np.linspace(0.1, 0.9, 9, dtype=dtype) + i for i in range(arity)]
        handles = [interp.TensorHandle(a, ty) for a in args]
        got = interp.interpreter_builder.create_extern_elementwise("", "", symbol, handles,
                                                                   ty, True)
        want = fn(*args).astype(dtype)
        if got.data.dtype != dtype or not np.array_equal(got.data, want, equal_nan=True):
            errors[symbol] = str(got.data.dtype)
print(json.dumps({"before": before, "errors": errors}))
'''


def test_every_filled_libdevice_function_is_numpy_in_its_own_dtype() -> None:
    needs_triton()
    got = run_python(SYMBOLS)
    assert "not supported in interpreter mode" in str(got["before"])
    assert got["errors"] == {}


DESCRIBE = '''
import json
import triton  # loaded, as torch._dynamo loads it, in the worker of a kernel with no Triton code
from tyingspec._src.kinds.linear_ce import interpreter
from tyingspec._src.kinds.linear_ce.adapter import call_linear_ce
from tyingspec._src.kinds.linear_ce.zoo import builtin_target

ev = call_linear_ce("ce-numpy", builtin_target("ce-numpy"), {"mode": "describe"}).evidence
print(json.dumps({"process": interpreter.interpreting(), "interpreted": ev["interpreted"],
                  "block_seen": ev["block_seen"]}))
'''


def test_a_kernel_launching_no_triton_kernel_is_not_interpreted() -> None:
    """The interpreter on and triton loaded in the worker say nothing of the kernel: a numpy
    (or plain torch) kernel keeps its 8101-token long case (judged interpreted, ce-long was cut
    to 241 tokens and a dE kept from the last block of 1024 passed)."""
    needs_triton()
    got = run_python(DESCRIBE)
    assert got["process"] is not None  # the process interprets...
    assert got["interpreted"] is None and got["block_seen"] is None  # ...no kernel of its


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize(("target", "construct"), [
    ("InlineAsm", "inline assembly (tl.inline_asm_elementwise)"),
    ("Erfinv", "the libdevice function __nv_erfinvf"),
])
def test_a_gap_it_cannot_fill_is_exit_2_naming_triton_and_the_construct(
        target: str, construct: str) -> None:
    needs_triton()
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # set by the worker
    out = subprocess.run([sys.executable, "-m", "tyingspec", "check", f"gaps:{target}",
                          "--kind", "linear-ce", "--case", "ce-plain"], cwd=TARGETS, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join(out.stdout.split())  # as one line, however the report wraps it
    assert f"the Triton interpreter of triton {triton.__version__} cannot run {construct}" \
        in text
    assert "gaps.py:" in text  # the kernel's own line


def test_the_worker_switches_the_interpreter_on_only_where_no_gpu_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    saved = sys.modules.pop("triton", None)  # as a worker is before the target's import
    try:
        monkeypatch.setattr(interpreter, "gpu_present", lambda: True)
        interpreter.before_import()
        assert "TRITON_INTERPRET" not in os.environ  # a GPU: compiled kernels
        monkeypatch.setattr(interpreter, "gpu_present", lambda: False)
        interpreter.before_import()
        assert os.environ["TRITON_INTERPRET"] == "1"
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the user's own choice is kept
        interpreter.before_import()
        assert os.environ["TRITON_INTERPRET"] == "0"
    finally:
        if saved is not None:
            sys.modules["triton"] = saved


def test_without_triton_nothing_is_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    saved = sys.modules.pop("triton", None)
    try:
        interpreter.before_import()
        assert "TRITON_INTERPRET" not in os.environ
        assert interpreter.install() == [] or interpreter.interpreting() is None
    finally:
        if saved is not None:
            sys.modules["triton"] = saved


def test_no_gpu_is_seen_without_a_driver_and_without_importing_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [])  # any import now fails: torch is not asked
    assert interpreter.gpu_present() is False
