"""``tyingspec check --kind torch`` over real architectures (``zoos/transformers_zoo.py``).

Each entry runs as a user runs it: ``python -m tyingspec check
zoos.transformers_zoo:<factory> --kind torch`` in a subprocess whose working directory is the
repository root (``tests`` has no ``__init__.py``; it imports from there as a namespace package,
and ``tyingspec check`` looks a ``module:attr`` target up from the current directory).  A
correct model must exit 0, an untied one 2 with "found no tie", a broken one 1 with its label.
Nothing is written into the repository.

The registry itself is checked with plain torch first: every correct and broken entry ties (or,
for a copy tie, declares a tie it does not have), every untied one does not, and each broken
entry's gradient differs from its correct twin's exactly where its bug says.

Only a handful of entries run in the default tier; the whole zoo is ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zoos import transformers_zoo as zoo
from zoos.transformers_zoo import FAST, ZOO, ZooEntry

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 600  # seconds for one whole `tyingspec check` (process start, imports, every case)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _param(entry: ZooEntry) -> Any:
    marks = () if entry.name in FAST else (pytest.mark.slow,)
    return pytest.param(entry, id=entry.name, marks=marks)


def _build(entry: ZooEntry) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = getattr(zoo, entry.factory)()
    return model


def _names_of_shared(model: nn.Module) -> list[list[str]]:
    """The parameter names that share one Parameter object, per shared Parameter."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _has_tie(model: nn.Module) -> bool:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is not None and get_out is not None and get_out() is not None:
        return get_in().weight is get_out().weight
    return bool(_names_of_shared(model))


# --- the registry, checked with plain torch --------------------------------------------------

def test_the_zoo_is_as_large_as_issue_17_asks() -> None:
    hf_tied = [e for e in ZOO if e.kind == "correct" and not e.name.startswith("scratch-")]
    assert len(hf_tied) >= 32
    assert len([e for e in ZOO if e.kind == "untied"]) >= 6
    broken_archs = {e.name.split("-")[0] for e in ZOO if e.kind == "broken"}
    assert len(broken_archs) >= 5
    assert len({e.name for e in ZOO}) == len(ZOO) and len({e.factory for e in ZOO}) == len(ZOO)
    assert set(FAST) <= {e.name for e in ZOO}


@pytest.mark.parametrize("entry", [_param(e) for e in ZOO if e.kind != "broken"])
def test_each_entry_ties_exactly_when_it_says(entry: ZooEntry) -> None:
    model = _build(entry)
    if entry.name == "scratch-torchtune-tied-linear":
        # torchtune's TiedLinear is no nn.Module: the head's use of the weight has no name
        assert _names_of_shared(model) == []
        assert model.output.tied_module.weight is model.tok_embeddings.weight
        return
    tied = entry.kind in ("correct", "no-power")
    assert _has_tie(model) == tied
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        assert config.tie_word_embeddings == tied


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy from the logits, in the model's dtype (float64 here)."""
    out = model(input_ids=tokens, labels=tokens)
    logits = out.logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                       tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("entry", [_param(e) for e in ZOO if e.kind == "broken"])
def test_each_broken_entry_breaks_its_gradient_where_its_bug_says(entry: ZooEntry) -> None:
    # the bug is the factory's suffix ("falcon_h1_copy_tie": arch "falcon_h1", bug "copy_tie")
    bug = next(b for b in zoo.BUGS if entry.factory.endswith("_" + b))
    arch = entry.factory[:-len(bug) - 1]
    tokens = torch.tensor([[3, 5, 3, 10, 7, 3, 5, 9], [11, 3, 12, 12, 8, 20, 4, 5]])

    def grad_of(factory: str) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
        torch.manual_seed(0)
        model = getattr(zoo, factory)().double().eval()
        loss = _loss(model, tokens)
        loss.backward()
        return model.get_input_embeddings().weight.grad.clone(), loss.detach(), model

    good, good_loss, _ = grad_of(arch)
    bad, bad_loss, model = grad_of(entry.factory)
    torch.testing.assert_close(bad_loss, good_loss, rtol=1e-12, atol=0)  # same forward
    wrong = {int(r) for r in ((bad - good).abs().amax(1) > 1e-9).nonzero().flatten()}
    present = set(tokens.flatten().tolist())
    if bug == "copy_tie":
        assert model.config.tie_word_embeddings
        assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
        assert wrong == set(range(bad.size(0)))  # the embedding keeps its input path only
    elif bug == "input_detached":
        assert wrong and wrong <= present | {0, 1, 2}  # + the decoder start/eos/pad rows
        assert {3, 5, 7, 12} <= wrong
    else:
        assert wrong and {3, 5, 12} <= wrong  # the repeated tokens
        assert not wrong & {4, 7, 8, 9, 10, 11, 20}  # tokens seen once are exact


# --- tyingspec check, as a user runs it --------------------------------------------------------

def _check(entry: ZooEntry) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tyingspec", "check",
                           f"zoos.transformers_zoo:{entry.factory}", "--kind", "torch"],
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("entry", [_param(e) for e in ZOO])
def test_tyingspec_check_gives_each_architecture_its_verdict(entry: ZooEntry) -> None:
    run = _check(entry)
    output = run.stdout + run.stderr
    assert run.returncode == entry.expected_exit, f"{entry.name} ({entry.notes}):\n{output}"
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("verdict:")]
    if entry.kind == "untied":
        assert "found no tie" in run.stdout, output
    elif entry.kind == "broken":  # the run's own diagnosis names the bug
        assert len(verdicts) == 1, output
        assert any(label in verdicts[0] for label in entry.expected_labels), output
    elif entry.kind == "no-power":  # never called correct, never called wrong
        assert verdicts and verdicts[0].startswith("verdict: no_power"), output
    else:
        assert verdicts and verdicts[0].startswith("verdict: correct"), output
