"""``--device`` for ``--kind torch`` (issue 51): ``TorchTarget(device=...)``, ``--device`` and
``tyingspec.check(device=)`` move the models a check trains, and the batches it hands them, to
that device; the gradients and the observed uses come back to the CPU, where they are judged
as before.

This machine has no GPU, so what runs everywhere is what does not need one: the device reaches
the model (a model that logs where it is moved and where its forward runs), the CPU named
explicitly gives the default's verdicts (a wrong model still named), and a device torch cannot
use is an adapter error naming it and torch's version (exit 2), never a silent run on the CPU.
The verdicts on a GPU are pinned by the last test, which runs where CUDA is present.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch_sources
from torch_sources import summary

import tyingspec
from tyingspec._src.front.check import CheckReport, check_target
from tyingspec._src.kinds.table import kind_spec


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


#: A tied model that logs, to ``LOG``, every device it is moved to and, at every forward, the
#: device of its input and of its weight (the worker is another process: the log is how a test
#: sees inside it); its loss and its step log the device of what they are handed.
LOGGING = '''
    LOG = {log!r}


    def log(**entry):
        with open(LOG, "a") as f:
            f.write(json.dumps(entry) + "\\n")


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.body = Body()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight
            small_init(self)

        def to(self, *args, **kwargs):
            where = kwargs.get("device", next((a for a in args
                                              if isinstance(a, (str, torch.device))), None))
            if where is not None:
                log(moved=str(torch.device(where)))
            return super().to(*args, **kwargs)

        def forward(self, idx):
            log(ids=str(idx.device), weight=str(self.wte.weight.device))
            return self.lm_head(self.body(self.wte(idx)))


    def loss(model, tokens, targets):
        log(loss_tokens=str(tokens.device), loss_targets=str(targets.device))
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


    def step(model, optimizer, batch):
        log(step_ids=str(batch.input_ids.device), step_labels=str(batch.labels.device))
        optimizer.zero_grad()
        loss(model, batch.input_ids, batch.labels).backward()
        optimizer.step()


    default = TorchTarget(model=Model, loss=loss, step=step)
    on_cpu = TorchTarget(model=Model, loss=loss, step=step, device="cpu")
    on_cuda = TorchTarget(model=Model, loss=loss, device="cuda")
    on_meta = TorchTarget(model=Model, loss=loss, device="meta")
    on_nowhere = TorchTarget(model=Model, loss=loss, device="nowhere")
'''


def _logged(tmp_path: Path, attr: str, **setting: str) -> tuple[CheckReport, list[dict[str, str]]]:
    """``tyingspec check dev_log:attr --kind torch`` on one case, and what the model logged."""
    log = tmp_path / f"{attr}.log"
    source = "import json\n" + torch_sources.PRELUDE + textwrap.dedent(LOGGING.format(log=str(log)))
    (tmp_path / "dev_log.py").write_text(source)
    cases = [c for c in kind_spec("torch").cases(0) if c.name == "repeated-tokens"]
    for key, value in setting.items():
        cases = [c.with_setting(key, value) for c in cases]
    report = check_target(f"dev_log:{attr}", "torch", 0, cases, paths=(str(tmp_path),),
                          shrink_budget=0)
    lines = log.read_text().splitlines() if log.exists() else []
    return report, [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.moved
def test_the_targets_device_reaches_the_model_its_batches_its_loss_and_its_step(
        tmp_path: Path) -> None:
    report, entries = _logged(tmp_path, "on_cpu")
    assert report.exit_code == 0, summary(report)
    # every model the check trains is moved where the target says, and is handed its batch,
    # its loss's tokens and its step's batch there
    assert {e["moved"] for e in entries if "moved" in e} == {"cpu"}, entries[:5]
    forwards = [e for e in entries if "ids" in e]
    assert forwards and all(e["ids"] == e["weight"] for e in forwards)
    assert any("loss_tokens" in e for e in entries) and any("step_ids" in e for e in entries)
    assert all(e["loss_tokens"] == e["loss_targets"] == "cpu" for e in entries
               if "loss_tokens" in e)
    assert all(e["step_ids"] == e["step_labels"] == "cpu" for e in entries if "step_ids" in e)
    # and the report says where the models ran
    configuration = next(f for f in report.results[0].diagnosis.findings
                         if f.check == "configuration")
    assert "on cpu, judged on the CPU" in configuration.detail


@pytest.mark.slow
@pytest.mark.moved
def test_without_a_device_the_model_is_not_moved(tmp_path: Path) -> None:
    report, entries = _logged(tmp_path, "default")
    assert report.exit_code == 0, summary(report)
    assert not [e for e in entries if "moved" in e]
    assert [e for e in entries if "ids" in e]  # the log works: it ran
    configuration = next(f for f in report.results[0].diagnosis.findings
                         if f.check == "configuration")
    assert "judged on the CPU" not in configuration.detail


@pytest.mark.slow  # ~10 s: the fast tier moves a target's own device and checks the flag's
def test_the_flag_moves_a_target_that_names_no_device(tmp_path: Path) -> None:
    report, entries = _logged(tmp_path, "default", device="cpu")
    assert report.exit_code == 0, summary(report)
    assert {e["moved"] for e in entries if "moved" in e} == {"cpu"}


@pytest.mark.parametrize("name, label", [("nanogpt", "correct"),
                                         ("nanogpt-embedding-no-accumulate",
                                          "duplicates_not_accumulated")])
def test_the_cpu_named_gives_the_defaults_verdicts(name: str, label: str) -> None:
    default = tyingspec.check(name, "torch", case="repeated-tokens", shrink_budget=0)
    named = tyingspec.check(name, "torch", case="repeated-tokens", shrink_budget=0,
                            device="cpu")
    assert named.results[0].case.setting_value("device") == "cpu"
    assert (named.exit_code, named.diagnosis_label) == (default.exit_code,
                                                        default.diagnosis_label)
    assert named.diagnosis_label == label, summary(named)


def _no_cuda_here() -> None:
    if _cuda():
        pytest.skip("this machine has CUDA: test_the_gpu_gives_the_cpus_verdicts runs instead")


def test_device_cuda_without_cuda_is_an_adapter_error_naming_it_and_torch() -> None:
    import torch

    _no_cuda_here()
    report = tyingspec.check("nanogpt", "torch", case="absent-tokens", device="cuda")
    assert report.exit_code == 2 and report.verdict == "adapter_error", summary(report)
    error = report.results[0].error or ""
    assert "--device cuda: torch sees no CUDA device here" in error
    assert f"torch {torch.__version__}" in error


def test_a_target_on_cuda_without_cuda_is_an_adapter_error(tmp_path: Path) -> None:
    _no_cuda_here()
    report, _ = _logged(tmp_path, "on_cuda")
    assert report.exit_code == 2, summary(report)
    assert "--device cuda: torch sees no CUDA device here" in summary(report)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr, words", [("on_meta", "the meta device holds no values"),
                                         ("on_nowhere", "--device nowhere: torch cannot place")])
def test_a_device_torch_cannot_compute_on_is_an_adapter_error(tmp_path: Path, attr: str,
                                                              words: str) -> None:
    report, entries = _logged(tmp_path, attr)
    assert report.exit_code == 2, summary(report)
    assert words in summary(report)
    assert not [e for e in entries if "ids" in e]  # refused before any forward


def test_two_devices_asked_for_are_an_adapter_error(tmp_path: Path) -> None:
    report, _ = _logged(tmp_path, "on_cpu", device="cuda")
    assert report.exit_code == 2, summary(report)
    assert "two devices asked for" in summary(report)
    assert "TorchTarget(device='cpu')" in summary(report)


def test_the_device_flag_takes_cpu_or_cuda() -> None:
    with pytest.raises(ValueError, match="--device tpu: expected one of cpu, cuda"):
        tyingspec.check("nanogpt", "torch", case="absent-tokens", device="tpu")


def test_device_cuda_on_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "tyingspec", "check", "nanogpt", "--kind",
                          "torch", "--device", "cuda", "--case", "absent-tokens"],
                         capture_output=True, text=True, check=False, timeout=600)
    text = " ".join((out.stdout + out.stderr).split())
    if _cuda():
        assert out.returncode == 0, text[-3000:]
    else:
        assert out.returncode == 2, text[-3000:]
        assert "--device cuda: torch sees no CUDA device here" in text
        assert "torch.cuda.is_available()" in text


def test_a_batch_moves_whole_and_the_observed_uses_are_cpu_copies() -> None:
    import torch

    from tyingspec._src.kinds.torch.batch import TorchBatch, model_device
    from tyingspec._src.kinds.torch.uses import _kept

    ids = torch.arange(6).reshape(2, 3)
    b = TorchBatch(ids, ids + 1, torch.ones_like(ids), real=ids >= 0)
    assert b.to(torch.device("cpu")) is b  # already there: no copy
    moved = b.to(torch.device("meta"))
    assert {t.device.type for t in (moved.tokens, moved.targets, moved.mask, moved.real)} \
        == {"meta"}
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")
    g = torch.ones(3, requires_grad=True) * 2
    kept = _kept(g)
    assert kept.device.type == "cpu" and not kept.requires_grad
    assert kept.data_ptr() != g.data_ptr()  # a copy: the model's later steps do not change it


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device; CI here has none")
@pytest.mark.parametrize("name", ["nanogpt", "nanogpt-embedding-no-accumulate",
                                  "nanogpt-input-path-dropped", "nanogpt-grad-assigned"])
def test_the_gpu_gives_the_cpus_verdicts(name: str) -> None:
    cpu = tyingspec.check(name, "torch", shrink_budget=0)
    gpu = tyingspec.check(name, "torch", shrink_budget=0, device="cuda")
    assert (gpu.exit_code, gpu.diagnosis_label) == (cpu.exit_code, cpu.diagnosis_label), \
        summary(gpu)
