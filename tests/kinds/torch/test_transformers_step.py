"""transformers architectures under the user's own training step (issue 49): ``TorchTarget(
step=...)`` with bfloat16 autocast, three accumulation micro-batches over padded batches with an
attention mask and ``labels=``, gradient clipping and AdamW, as a transformers training loop
runs them.  Every correct architecture exits 0 and every broken one exits 1 with its label,
judged at every step against the uses its forwards took.

Slow: each is a whole ``tyingspec check`` of a real architecture (built tiny from
``zoos/transformers_zoo.py``; nothing is downloaded).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from torch_sources import summary

from tyingspec._src.front.check import check_target
from tyingspec._src.kinds.table import kind_spec
from zoos.transformers_zoo import ZOO

REPO = Path(__file__).resolve().parents[3]  # zoos/ is imported from the repository root

STEP = '''
    import torch

    from zoos import transformers_zoo as zoo
    from tyingspec import TorchTarget


    def optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


    def step(model, optimizer, batch):
        optimizer.zero_grad()
        parts = batch.micro_batches(3)
        for part in parts:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=part.input_ids, attention_mask=part.attention_mask,
                            labels=part.labels)
            (out.loss / len(parts)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


    target = TorchTarget(model=zoo.{factory}, optimizer=optimizer, step=step)
'''

CORRECT = ["gpt2", "llama", "qwen2", "mistral", "gemma", "phi3", "olmo2", "opt", "bart"]
BROKEN = [e.name for e in ZOO if e.kind == "broken"][:3]
ENTRIES = {e.name: e for e in ZOO}


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRECT + BROKEN)
def test_an_architecture_under_the_users_own_step(tmp_path: Path, name: str) -> None:
    entry = ENTRIES[name]
    module = f"step_{entry.factory}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(STEP.format(factory=entry.factory)))
    cases = [c for c in kind_spec("torch").cases(0) if c.name == "repeated-tokens"]
    rep = check_target(f"{module}:target", "torch", 0, cases,
                       paths=(str(tmp_path), str(REPO)))
    assert rep.exit_code == entry.expected_exit, summary(rep)
    if entry.kind == "broken":
        assert rep.diagnosis_label in entry.expected_labels, summary(rep)
        return
    steps = [f for r in rep.results for f in r.diagnosis.findings
             if f.check == "gradient at every training step"]
    assert steps and steps[0].outcome == "passed" and "your step" in steps[0].detail, \
        summary(rep)
