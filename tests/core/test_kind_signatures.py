"""A kernel is recognised by its kind's own contract, not by counting parameter names."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import tyingspec

FEW_OPTIONS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F

    class FewOptions(torch.nn.Module):
        # one constructor option, no bias: torchtune's and litgpt's shape
        def __init__(self, reduction: str = "mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, weight, input, target, bias=None):
            logits = F.linear(input, weight, bias).float()
            return F.cross_entropy(logits, target, reduction=self.reduction)
''')


@pytest.mark.slow
@pytest.mark.moved
def test_a_liger_style_class_with_one_option_is_a_linear_ce_kernel(tmp_path: Path) -> None:
    # it was refused as "looks like a torch adapter": fewer than four constructor parameters
    (tmp_path / "few_options_kernel.py").write_text(FEW_OPTIONS)
    report = tyingspec.check("few_options_kernel:FewOptions", kind="linear-ce",
                             paths=[str(tmp_path)])
    assert report.load_error is None, report.load_error
    assert report.ok, report.diagnosis
    assert len(report.cases) >= 3
