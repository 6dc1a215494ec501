"""The jax kind: JAX and Flax models checked through the engine, the CLI, the plugin, the kill
matrix and the JSON report.

Every built-in of the jax zoo (kinds.jax.zoo) must reach its expected label, every correct one
must pass; the tie must be found in all three target forms; the reference must not trust a
target's ``custom_vjp`` backward.  Built-ins run in-process (one jax import and one set of
compiles per xdist worker); the default tier runs one case each, the slow tier every case
through the command line, the plugin and the kill matrix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import Scratch
from report_schemas import assert_valid

from tyingspec import standard_cases
from tyingspec._src.engine.observe import load, observe, own_case
from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.jax.zoo import JAX_BUILTINS
from tyingspec._src.kinds.table import KINDS

ROOT = Path(__file__).resolve().parents[3]

# XLA compiling each tiny model is most of this module's time (~1 s a program, two or more per
# call).  LLVM's optimisation passes (numerics unchanged: fast-math is off either way) and
# Eigen's intra-op threads (which on 2 shared cores only contend) are turned off for this
# module's processes, the subprocesses it starts included: the default tier took 87 s with
# them, 55 s without.  Set before jax starts its backend (nothing above imports jax).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
BUILTINS = sorted(JAX_BUILTINS)
ONE_CASE = [c for c in standard_cases(0) if c.name == "repeated-tokens"]
TOKENS = np.array([3, 5, 3, 0, 7, 3, 5, 9, 1, 3, 2, 2, 8, 0, 4, 5])
TARGETS = np.roll(TOKENS, -1)


#: The checks the default tier runs per built-in: only the one that must reach its label (the
#: rows are judged on every call), since each check compiles the model again; the slow tier
#: runs every check of every built-in.
DEFAULT_CHECKS: dict[str, tuple[str, ...]] = {
    "function-two-paths": ("optimizer",), "function-stale-step": ("identity",)}

#: The default tier's built-ins: every broken one and the cheapest correct one (a pure
#: function: no Flax module to trace); the NNX and Linen correct ones run in the slow tier.
DEFAULT_BUILTINS = [n for n in BUILTINS
                    if JAX_BUILTINS[n].breaks is not None or n == "function-tied"]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name", DEFAULT_BUILTINS)
def test_every_jax_builtin_gets_its_label_on_a_repeated_token_batch(name: str) -> None:
    b = JAX_BUILTINS[name]
    target = load(name, "jax")
    o = observe(target, own_case(target, ONE_CASE[0]),
                checks=DEFAULT_CHECKS.get(name, ("gradient",)))
    assert o.label == b.expected, o.diagnosis.headline()
    if b.breaks is None:
        assert o.diagnosis.findings and not any(f.failed for f in o.diagnosis.findings)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILTINS)
def test_every_jax_builtin_gets_its_label_from_every_check(name: str) -> None:
    b = JAX_BUILTINS[name]
    report = check_target(name, "jax", 0, ONE_CASE)
    assert report.load_error is None
    labels = [r.diagnosis.label for r in report.results if r.diagnosis is not None]
    if b.breaks is None:
        assert report.exit_code == 0, [r.diagnosis and r.diagnosis.headline()
                                       for r in report.results]
        assert labels == ["correct"]
    else:
        assert report.exit_code == 1
        assert report.diagnosis_label == b.expected, labels
        assert all(f"tyingspec check {name} --kind jax" in r.replay for r in report.results)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILTINS)
def test_every_jax_builtin_gets_its_label_from_the_command_line(name: str) -> None:
    b = JAX_BUILTINS[name]
    run = subprocess.run([sys.executable, "-m", "tyingspec", "check", name, "--kind", "jax"],
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == (0 if b.breaks is None else 1), out[-3000:]
    assert f"verdict: {'correct' if b.breaks is None else 'wrong (' + b.expected + ')'}" in out


def _describe(spec: str, obj: object) -> dict[str, object]:
    from tyingspec._src.kinds.jax.adapter import call_jax

    tie = call_jax(spec, obj, {"mode": "describe"}).evidence["tie"]
    assert isinstance(tie, dict)
    return tie


def _output_dataclass_model() -> object:
    """A Linen model returning its logits in an output dataclass (as DeepMind gemma's
    ``Transformer`` returns ``Output(logits=...)``)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import struct

    from tyingspec._src.kinds.jax.target import JaxTarget

    @struct.dataclass
    class Output:
        logits: jax.Array
        cache: None = None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> Output:
            emb = nn.Embed(37, 8)
            x = emb(tokens)
            return Output(logits=emb.attend(x + nn.Dense(8)(jnp.tanh(x))))

    m = LM()
    return JaxTarget(module=m, params=lambda: m.init(jax.random.PRNGKey(0),
                                                     jnp.zeros((2, 8), jnp.int32)))


def test_a_model_returning_an_output_with_logits_is_read_by_its_logits() -> None:
    """Before: exit 2, "the loss is not a floating scalar ... float32[2,8,37]" (gemma's
    ``Output``)."""
    tie = _describe("output-dataclass", _output_dataclass_model())
    assert (tie["embedding"], tie["how"], tie["vocab"]) == ("params/Embed_0/embedding",
                                                            "one leaf", 37)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("module,attr,form,table", [
    ("nnx_model", "make_model", "nnx", "embed/embedding"),
    ("linen_model", "target", "linen", "params/Embed_0/embedding"),
    ("loss_fn", "target", "function", "embed"),
])
def test_the_tie_is_discovered_in_each_target_form(module: str, attr: str, form: str,
                                                   table: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))  # examples/ is the checkout's, not installed

    obj = getattr(importlib.import_module(f"examples.jax.{module}"), attr)
    tie = _describe(f"examples.jax.{module}:{attr}", obj)
    assert (tie["form"], tie["embedding"], tie["head"], tie["how"]) == (form, table, table,
                                                                        "one leaf")
    assert (tie["vocab"], tie["width"]) == (37, 8)


def test_an_undeclared_pure_function_tie_is_found_by_its_uses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    monkeypatch.syspath_prepend(str(ROOT))  # examples/ is the checkout's, not installed

    from examples.jax.loss_fn import target

    assert _describe("loss_fn", replace(target, table=None))["embedding"] == "embed"


def test_a_copy_and_an_aliased_tree_are_told_apart() -> None:
    from tyingspec._src.kinds.jax import zoo

    assert _describe("nnx-copy-tie", zoo.nnx_copy_tie)["how"] == "copy"
    assert _describe("function-two-paths", zoo.function_two_paths)["how"] == \
        "two paths, one array"


@pytest.mark.slow
@pytest.mark.moved
def test_the_reference_never_runs_the_targets_custom_vjp_backward() -> None:
    import jax

    from tyingspec._src.kinds.jax import split, zoo
    from tyingspec._src.kinds.jax.discover import build_form, discover, leaf

    form = build_form("set", zoo.function_custom_vjp_set())
    t, y = TOKENS.reshape(2, 8), TARGETS.reshape(2, 8)
    tie, _, tr = discover("set", form, t, y)
    i = tr.paths.index(tie.embedding)
    obs = split.observe(tr, i, i)
    assert obs.problem is None
    # the reference: plain autodiff of the same model without the custom_vjp
    right = zoo.function_tied()
    expected = np.asarray(jax.grad(right.loss_fn)(form.params, t, y)["embed"], np.float64)
    np.testing.assert_allclose(obs.dE_in + obs.dE_out, expected, rtol=1e-5, atol=1e-7)
    own = np.asarray(leaf(jax.grad(form.loss)(form.params, t, y), "embed"), np.float64)
    repeated = [3, 5, 0, 2]  # the rows .at[].set keeps one occurrence of
    assert np.abs(own - expected)[repeated].max() > 1e-3


@pytest.mark.slow
@pytest.mark.moved
def test_a_model_without_a_tie_exits_2_naming_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "untied_jax.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        from flax import nnx
        class M(nnx.Module):
            def __init__(self):
                rngs = nnx.Rngs(0)
                self.embed = nnx.Embed(11, 4, rngs=rngs)
                self.out = nnx.Embed(11, 4, rngs=rngs)
            def __call__(self, t):
                return self.out.attend(jnp.tanh(self.embed(t)))
        def make():
            return M()
    """))
    run = subprocess.run([sys.executable, "-m", "tyingspec", "check", "untied_jax:make",
                          "--kind", "jax", "--case", "repeated-tokens"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stdout + run.stderr
    out = run.stdout + run.stderr
    assert "found no tie" in out and "untied_jax:make" in out
    assert "embed/embedding" in out and "out/embedding" in out


def test_a_target_with_two_forms_is_bad_input() -> None:
    from tyingspec._src.core.adapters import AdapterError
    from tyingspec._src.kinds.jax import zoo
    from tyingspec._src.kinds.jax.target import JaxTarget

    with pytest.raises(AdapterError, match="exactly one of model, module, loss_fn"):
        _describe("two", JaxTarget(model=zoo.nnx_tied, loss_fn=lambda p, t, y: 0.0))


@pytest.mark.slow
def test_the_json_report_of_a_jax_check_validates(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["check", "nnx-copy-tie", "--kind", "jax", "--case", "repeated-tokens",
                 "--json", str(out)]) == 1
    payload = json.loads(out.read_text())
    assert_valid(payload, "check-1.json")
    assert payload["kind"] == "jax"
    checks = payload["cases"][0]["diagnosis"]["checks"]
    assert checks[0]["check"] == "tie discovered" and checks[0]["label"] == "tie_is_a_copy"


def test_the_kind_imports_no_jax_until_it_is_used() -> None:
    code = ("import sys; from tyingspec._src.kinds.table import KINDS; "
            "s = KINDS['jax']; s.builtins(); import tyingspec.properties; "
            "print('jax' in sys.modules, 'flax' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.split() == ["False", "False"], run.stderr
    assert "jax" in KINDS


def tied_at_2x8() -> object:
    from dataclasses import replace

    from tyingspec._src.kinds.jax import zoo

    return replace(zoo.function_tied(), batch_size=2, seq_len=8)


def set_at_2x8() -> object:
    from dataclasses import replace

    from tyingspec._src.kinds.jax import zoo

    return replace(zoo.function_custom_vjp_set(), batch_size=2, seq_len=8)


@pytest.mark.slow
def test_a_bfloat16_model_is_judged_at_bfloat16_and_a_bug_still_shows() -> None:
    # on a short batch (the target's seq_len) a bug in the rows of the batch's tokens shows
    for attr, label in (("tied_at_2x8", "correct"), ("set_at_2x8", "duplicates_not_accumulated")):
        target = load(f"test_jax_kind:{attr}", "jax", "bfloat16", isolate=False)
        o = observe(target, own_case(target, ONE_CASE[0]))
        assert (o.case.N, o.precision, o.label) == (16, "bfloat16", label), o.diagnosis.headline()
    # on the drawn batches a row read hundreds of times rounds, in bfloat16, by more than
    # repeats lost: beyond bfloat16's bound there, but never passed as correct
    bad = check_target("function-custom-vjp-set", "jax", 0, precision="bfloat16")
    assert bad.exit_code != 0 and bad.verdict in ("wrong", "no_power"), bad.diagnosis


@pytest.mark.slow
@pytest.mark.parametrize("adapter,code,label", [
    ("examples.jax.nnx_model:make_model", 0, None),
    ("function-custom-vjp-set", 1, "duplicates_not_accumulated")])
def test_the_plugin_runs_the_jax_properties(scratch: Scratch, adapter: str, code: int,
                                            label: str | None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the worker takes this process's sys.path: examples/ is the checkout's, not installed
    monkeypatch.syspath_prepend(str(ROOT))
    run = scratch.runpytest(f"--tyingspec-adapter={adapter}", "--tyingspec-kind=jax",
                            "--tyingspec-max-examples=3")
    out = run.stdout.str()
    assert run.ret == code, out[-3000:]
    assert "jax_gradient_by_path" in out
    if label is not None:
        assert label in out


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILTINS)
def test_the_kill_matrix_kills_each_broken_jax_builtin_and_passes_each_correct(
        name: str) -> None:
    from tyingspec._src.core.kind import zoo as as_rows
    from tyingspec._src.front.kill_matrix import run_row
    from tyingspec._src.kinds.jax import zoo

    impl = as_rows("jax", zoo, JAX_BUILTINS)[name]
    row = run_row(impl, "jax", max_examples=3)
    assert row.label == impl.expected, row.label
    assert set(row.cells) == set(KINDS["jax"].properties)
    if impl.correct:
        assert not row.killed_by and not any(c.failed for c in row.cells.values()), row.cells
    else:
        assert row.killed_by, row.cells
        assert impl.expected in {c.label for c in row.cells.values() if c.failed}, row.cells


@pytest.mark.slow
def test_the_mutants_command_takes_the_jax_kind(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import ArgumentParser

    from tyingspec._src.front.kill_matrix import configure_parser, run

    parser = ArgumentParser()
    configure_parser(parser)
    out = tmp_path / "m.json"
    code = run(parser.parse_args(["--kind", "jax", "--max-examples", "3", "--only",
                                  "function-custom-vjp-set", "--only", "function-tied",
                                  "--json", str(out)]))
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    assert "mutation score: 1/1 = 100.0%" in text
    data = json.loads(out.read_text())
    assert_valid(data, "mutants-1.json")
    (row,) = data["mutants"]
    assert (row["name"], row["kind"], row["ok"]) == ("function-custom-vjp-set", "jax", True)
    assert [s["name"] for s in data["styles"]] == ["function-tied"]


def test_a_check_leaves_jax_float64_switch_as_it_found_it() -> None:
    """A call switches on JAX's float64 for itself; in the checking process (a built-in) the
    switch is the user's, and comes back as it was."""
    import jax

    was = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", False)
    try:
        target = load("function-tied", "jax")
        assert observe(target, own_case(target, ONE_CASE[0])).label == "correct"
        assert jax.config.jax_enable_x64 is False
    finally:
        jax.config.update("jax_enable_x64", was)


def test_a_correct_float32_model_on_a_batch_it_fits_passes_the_forward_check() -> None:
    """One token predicting itself saturates the softmax of a residual model (``g = p - 1``
    from two numbers close to 1): the float32 gradient is off the float64 loss's by more than
    float32's unit roundoff, as JAX's own gradient of the float32 forward is.  That is the
    forward's rounding, not a wrong backward (the kill matrix condemned the correct
    function-tied on row 8 of such a batch)."""
    from tyingspec._src.kinds.jax import zoo
    from tyingspec._src.kinds.jax.adapter import call_jax

    t = np.full(16, 8)
    out = call_jax("function-tied", zoo.function_tied,
                   {"tokens": t, "targets": t, "seed": 27712, "checks": ("forward",)})
    (f,) = [f for f in out.findings if f.check == "gradient against the forward"]
    assert not f.failed, f.line()
    assert "no more than float32's rounding" in f.detail, f.detail


def test_a_worker_compiles_cheaply_unless_the_user_set_the_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's XLA flags: each of ``CHEAP_COMPILES`` the user's ``XLA_FLAGS`` does not
    set, added before the user's (which are kept); nothing outside a worker, nothing once the
    backend has started (XLA would not read them)."""
    from jax._src import xla_bridge

    from tyingspec._src.core.process_state import WORKER_ENV
    from tyingspec._src.kinds.jax import adapter

    user = "--xla_backend_optimization_level=2 --xla_dump_to=/tmp/x"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", user)
    monkeypatch.delenv(WORKER_ENV, raising=False)
    adapter._cheap_compiles()
    assert os.environ["XLA_FLAGS"] == user  # the user's own process: untouched
    monkeypatch.setenv(WORKER_ENV, "1")
    adapter._cheap_compiles()
    assert os.environ["XLA_FLAGS"] == f"--xla_llvm_disable_expensive_passes=true {user}"
    monkeypatch.setenv("XLA_FLAGS", user)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    adapter._cheap_compiles()
    assert os.environ["XLA_FLAGS"] == user
