"""The torch kind: a user's own nn.Module checked through the engine, the CLI and the plugin.

Every built-in of the torch zoo (kinds.torch.zoo, whose own tests prove each bug with
plain torch) must reach its expected label through ``tyingspec check --kind torch``, with a
replay line, and through the property suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import Scratch
from tyingspec.properties import PROPERTIES, PropertyFailure

from tyingspec import standard_cases
from tyingspec._src.engine.observe import load, observe, own_case
from tyingspec._src.front.check import check_target
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.table import KINDS
from tyingspec._src.kinds.torch.zoo import TORCH_BUILTINS

BUILTINS = sorted(TORCH_BUILTINS)
BROKEN = [n for n in BUILTINS if TORCH_BUILTINS[n].breaks is not None]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("name", BUILTINS)
def test_every_torch_builtin_gets_its_label_from_check(name: str) -> None:
    b = TORCH_BUILTINS[name]
    report = check_target(name, "torch", 0, standard_cases(0))
    assert report.load_error is None
    labels = {r.diagnosis.label for r in report.results if r.diagnosis is not None}
    if b.breaks is None:
        assert report.exit_code == 0, [(r.case.name, r.diagnosis and r.diagnosis.headline())
                                       for r in report.results]
        assert labels == {"correct"}
    else:
        assert report.exit_code == 1
        assert report.diagnosis_label == b.expected, labels
        wrong = [r for r in report.results if r.status == "wrong"]
        assert all(f"tyingspec check {name} --kind torch" in r.replay for r in wrong)


def test_the_model_shape_is_the_models_own() -> None:
    # its vocabulary and width; its whole context (8 positions), in batches of a thousand
    # tokens or more (at most 16 sequences)
    report = check_target("gpt2", "torch", 0, standard_cases(0))
    case = report.results[0].case
    assert (case.V, case.d, case.N) == (61, 16, 16 * 8)
    assert "B=16,T=8" in case.setting
    assert any("V=61 d=16" in n and "16 x 8 = 128 tokens" in n for n in report.notes)
    # the probe model's settings do not apply to a model that brings its own
    assert {r.case.name for r in report.results} == {
        "absent-tokens", "repeated-tokens", "one-token-repeated", "token-zero"}


def test_each_check_is_named_with_its_invariant_in_the_report(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "nanogpt", "--kind", "torch", "--case", "repeated-tokens"]) == 0
    out = capsys.readouterr().out
    for check in ("tie discovered", "identity after deepcopy",
                  "identity after load_state_dict(assign=True) + re-tie",
                  "identity after a safetensors round trip", "optimizer AdamW",
                  "gradient against the forward", "fresh gradient", "micro-batches accumulate"):
        assert check in out
    assert "[the embedding and the head are one Parameter with one storage]" in out
    assert "forward evaluations" in out


def test_a_copy_tie_report_leads_with_the_diagnosis(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    code = main(["check", "nanogpt-copy-tie", "--kind", "torch", "--case", "repeated-tokens",
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 1
    diag_line = next(i for i, line in enumerate(out.splitlines()) if "diagnosis:" in line)
    rows_line = next(i for i, line in enumerate(out.splitlines()) if "rows:" in line)
    assert diag_line < rows_line
    assert "tie_is_a_copy" in out and "two Parameters" in out
    assert "replay: tyingspec check nanogpt-copy-tie --kind torch" in out
    payload = json.loads(out_json.read_text())
    checks = payload["cases"][0]["diagnosis"]["checks"]
    assert checks[0]["check"] == "tie discovered" and checks[0]["outcome"] == "failed"
    assert checks[0]["label"] == "tie_is_a_copy"


def _check_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tyingspec check ARGS`` as a user runs it, from ``cwd`` (where the target module is)."""
    return subprocess.run([sys.executable, "-m", "tyingspec", "check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_a_model_without_a_tie_exits_2(tmp_path: Path) -> None:
    (tmp_path / "untied_model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte = nn.Embedding(11, 4)
                self.lm_head = nn.Linear(4, 11, bias=False)
            def forward(self, idx):
                return self.lm_head(torch.tanh(self.wte(idx)))
        def make():
            return M()
    """))
    run = _check_in(tmp_path, "untied_model:make", "--kind", "torch")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "found no tie" in run.stdout


@pytest.mark.slow
@pytest.mark.moved
def test_a_user_module_runs_isolated_with_a_torch_target_spec(tmp_path: Path) -> None:
    # a plain logits model named through TorchTarget: the default loss convention applies
    (tmp_path / "plain_model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from tyingspec import TorchTarget
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(13, 6)
                self.out = nn.Linear(6, 13, bias=True)
                self.out.weight = self.emb.weight
            def forward(self, idx):
                return self.out(torch.tanh(self.emb(idx)))
        target = TorchTarget(model=M, batch_size=2, seq_len=5)
    """))
    run = _check_in(tmp_path, "plain_model:target", "--kind", "torch")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "V=13 d=6 N=10" in run.stdout


def test_the_torch_kind_lists_its_own_properties() -> None:
    props = KINDS["torch"].properties
    assert all(PROPERTIES[p].kinds == ("torch",) for p in props)
    assert "sum_of_paths" not in props


@pytest.mark.parametrize("name,prop", [
    ("nanogpt-grad-assigned", "torch_micro_batches_accumulate"),
    ("nanogpt-grad-not-zeroed", "torch_fresh_gradient"),
    ("nanogpt-embedding-no-accumulate", "torch_gradient_against_forward"),
    ("nanogpt-optimizer-both-names", "torch_optimizer_sees_tie_once"),
    ("nanogpt-retie-clones", "torch_tie_identity"),
])
def test_each_torch_property_fails_its_bug_and_passes_the_correct_model(name: str,
                                                                        prop: str) -> None:
    case = next(c for c in standard_cases(0) if c.name == "repeated-tokens")
    broken, good = load(name, "torch"), load("nanogpt", "torch")
    with pytest.raises(PropertyFailure) as info:
        PROPERTIES[prop].check(broken, case)
    assert info.value.label == TORCH_BUILTINS[name].expected
    PROPERTIES[prop].check(good, case)


def test_padding_idx_is_honoured_not_reported() -> None:
    target = load("nanogpt-padding", "torch")
    for case in standard_cases(0)[:4]:
        o = observe(target, own_case(target, case))
        assert o.label == "correct", o.diagnosis.headline()


PLUGIN_ADAPTERS = [("nanogpt", 0, None), ("nanogpt-grad-assigned", 1, "gradient_assigned")]


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("adapter,code,label", PLUGIN_ADAPTERS)
def test_the_plugin_runs_the_torch_properties(scratch: Scratch, adapter: str, code: int,
                                              label: str | None) -> None:
    run = scratch.runpytest(f"--tyingspec-adapter={adapter}", "--tyingspec-kind=torch",
                            "--tyingspec-max-examples=5")
    out = run.stdout.str()
    assert run.ret == code, out[-3000:]
    assert "torch_micro_batches_accumulate" in out
    if label is not None:
        assert label in out and "--tyingspec-replay=" in out


PADDED_ADAPTER = textwrap.dedent("""
    import numpy as np
    from tyingspec._src.core.paths import forward_parts
    def _run(E, W, b, tokens, targets, res, s_in, pad, mask_out):
        t = np.asarray(tokens).reshape(-1); y = np.asarray(targets).reshape(-1)
        p = forward_parts(E, E, W, b, t, y, res, s_in)
        rows = p.input_rows.copy()
        if pad is not None:
            rows[t == pad] = 0  # nn.Embedding(padding_idx=pad): no input path into row pad
        dE = p.g.T @ p.h
        np.add.at(dE, t, rows)
        if mask_out and pad is not None:
            dE[pad] = 0  # the bug: the output path masked too
        return {"loss": p.loss, "dE": dE, "dW": p.dW, "db": p.db}
    def good(E, W, b, tokens, targets, *, res=1.0, s_in=1.0, padding_idx=None):
        return _run(E, W, b, tokens, targets, res, s_in, padding_idx, False)
    def masked_both(E, W, b, tokens, targets, *, res=1.0, s_in=1.0, padding_idx=None):
        return _run(E, W, b, tokens, targets, res, s_in, padding_idx, True)
    def ignores_it(E, W, b, tokens, targets, *, res=1.0, s_in=1.0, padding_idx=None):
        return _run(E, W, b, tokens, targets, res, s_in, None, False)
""")


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr,code,label", [("good", 0, None),
                                             ("masked_both", 1, "padding_row_masked"),
                                             ("ignores_it", 1, None)])
def test_the_probe_model_contract_takes_padding_idx(tmp_path: Path, attr: str, code: int,
                                                    label: str | None) -> None:
    (tmp_path / "padded.py").write_text(PADDED_ADAPTER)
    out = tmp_path / "r.json"
    run = _check_in(tmp_path, f"padded:{attr}", "--padding-idx", "0", "--json", str(out))
    assert run.returncode == code, run.stdout[-2000:]
    payload = json.loads(out.read_text())
    if label is not None:
        assert payload["diagnosis"] == label
        assert "--padding-idx 0" in run.stdout  # the replay keeps the declaration
    if attr == "ignores_it":  # an input path into row 0 where the model declared none
        labels = {c.get("label") for c in payload["cases"]}
        assert labels - {"correct", "no_power"}, labels
    # without --padding-idx the adapter is not passed padding_idx: its unpadded contract holds
    if attr == "good":
        plain = _check_in(tmp_path, "padded:good", "--case", "token-zero")
        assert plain.returncode == 0, plain.stdout[-2000:]


def test_a_builtin_name_runs_in_its_own_kind_without_kind(
        capsys: pytest.CaptureFixture[str]) -> None:
    # `tyingspec check --list` names each built-in with its kind; the name alone reaches it
    assert main(["check", "nanogpt-copy-tie", "--case", "repeated-tokens"]) == 1
    out = capsys.readouterr().out
    assert "--kind torch" in out and "tie_is_a_copy" in out
    assert main(["check", "ce-scale-dropped", "--case", "ce-logit-scale"]) == 1
    assert "logit_scale_dropped" in capsys.readouterr().out


def test_a_check_leaves_the_processs_torch_as_it_found_it() -> None:
    """A built-in runs in the checking process: the thread count and the global RNG it sets for
    its call (one thread, seeded weights) are the user's, and come back as they were."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the one thread a call sets for itself
    try:
        rng = torch.random.get_rng_state().clone()
        target = load("nanogpt", "torch")
        assert observe(target, own_case(target, standard_cases(0)[1])).label == "correct"
        assert torch.get_num_threads() == 2
        assert torch.equal(torch.random.get_rng_state(), rng)
    finally:
        torch.set_num_threads(threads)


_SAMPLING_MODEL = """
import torch
from torch import nn
from tyingspec import TorchTarget
class M(nn.Module):
    # tied; the forward draws from torch's generator in train() mode (as PhiMoE's router does)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight
    def forward(self, idx):
        h = torch.tanh(self.emb(idx))
        noise = torch.rand(h.shape[:-1] + (1,))  # one draw per token
        if {uses_noise}:
            h = h * (1 + noise)
        if {batch_bug} and idx.shape[0] == 1:  # a bug only micro-batches show
            h = h * 0.5
        return self.out(h)
target = TorchTarget(model=M, batch_size=2, seq_len=5)
"""


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("uses_noise, batch_bug, code, finding", [
    (True, False, 0, "n/a  micro-batches accumulate"),
    (False, True, 1, "FAIL micro-batches accumulate")])
def test_a_sampling_forward_excuses_micro_batches_only_where_its_draw_moves_the_gradient(
        tmp_path: Path, uses_noise: bool, batch_bug: bool, code: int, finding: str) -> None:
    # a forward whose gradient depends on torch's generator draws other numbers for a
    # micro-batch: n/a, not wrong; a draw that changes nothing excuses no micro-batch bug
    (tmp_path / "sampling_model.py").write_text(
        _SAMPLING_MODEL.format(uses_noise=uses_noise, batch_bug=batch_bug))
    run = _check_in(tmp_path, "sampling_model:target", "--kind", "torch")
    assert run.returncode == code, run.stdout + run.stderr
    assert finding in run.stdout, run.stdout


def test_a_pad_token_named_in_a_composite_models_text_config_counts_and_no_other_config_does(
        ) -> None:
    """transformers' composite models (Gemma3, Fuyu, GOT-OCR2: a language model beside a vision
    tower) name the pad token in ``config.text_config`` and their language model's config, not
    on the top-level config; a sweep of transformers 5.25's causal-LM architectures found six
    correct models flagged ``padding_idx_on_real_token`` for it.  The whole command on the
    real model is in the transformers zoo (``gemma3-composite``); here, what counts as named:
    the text config does, a config of another vocabulary (the vision tower's) does not."""
    import torch

    from tyingspec._src.kinds.torch.adapter import _declared_padding
    from zoos import transformers_zoo as zoo

    torch.manual_seed(0)
    model = zoo.gemma3_composite()
    assert model.get_input_embeddings().padding_idx == 0
    assert getattr(model.config, "pad_token_id", None) is None  # not on the top-level config
    assert _declared_padding(model, zoo.V) == {0}
    # named nowhere in the language model's configs, but by the vision tower's: not this pad
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "pad_token_id", None) is not None:
            config.pad_token_id = None
    model.config.text_config.pad_token_id = None
    model.config.vision_config.pad_token_id = 0
    assert 0 not in _declared_padding(model, zoo.V)
    # and of the language model's configs, its own alone is enough
    model.model.language_model.config.pad_token_id = 0
    assert _declared_padding(model, zoo.V) == {0}


def _positions_model(shift: int, error: type[Exception]) -> Any:
    """A tied model whose learned position table counts from its padding_idx (0) + 1, as
    RoBERTa's does, and reads ``shift`` positions further (ProphetNet's predicting stream reads
    one further): a longer sequence raises ``error``."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(11, 8)
            self.pos_emb = nn.Embedding(16, 8, padding_idx=0)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> Any:
            T = idx.shape[1]
            if T + shift >= self.pos_emb.num_embeddings:  # positions 1 + shift .. T + shift
                raise error("index out of range in self")
            x = self.wte(idx) + self.pos_emb(torch.arange(T) + 1 + shift)
            logits = x @ self.wte.weight.T
            return logits, F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    return Shifted()


@pytest.mark.parametrize(("shift", "error", "expected"), [
    (0, IndexError, 15),  # RoBERTa's rule: 16 - (0 + 1) positions
    (1, IndexError, 14),  # one further: a position fewer
    (2, IndexError, 13),
    (1, ValueError, 15),  # not an index past the table: the length stays, the check reports it
])
def test_a_position_table_counted_from_padding_idx_fits_the_sequence_its_forward_can_index(
        shift: int, error: type[Exception], expected: int) -> None:
    """transformers' ProphetNetForCausalLM raised an IndexError at the length RoBERTa's rule
    allows (exit 2 on a correct model, in a sweep of transformers 5.25's causal-LM
    architectures; the whole command on it is in the transformers zoo): the check's sequence
    is the longest its forward can index, found a position at a time."""
    from tyingspec._src.kinds.torch.discover import describe
    from tyingspec._src.kinds.torch.target import TorchTarget

    model = _positions_model(shift, error)
    tie, _ = describe("shifted", model, TorchTarget(model=lambda: model))
    assert (tie.embedding, tie.seq_len) == ("wte.weight", expected)
