"""What the torch-kind test files share: the source every test model module starts with, and
how a model is written into ``tmp_path`` and checked in a worker process as a user's
``module:make_model`` is."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tyingspec._src.front.check import CheckReport, check_target
from tyingspec._src.kinds.table import kind_spec

#: What every model module starts with: one residual tanh block and a LayerNorm (the body), and
#: an init small enough that no softmax saturates.
PRELUDE = textwrap.dedent('''
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    from tyingspec import TorchTarget

    V, D, T = 41, 12, 8


    class Body(nn.Module):
        def __init__(self, d=D, dtype=None):
            super().__init__()
            self.fc = nn.Linear(d, d, dtype=dtype)
            self.ln = nn.LayerNorm(d, dtype=dtype)

        def forward(self, x):
            return self.ln(x + torch.tanh(self.fc(x)))


    def small_init(model, std=0.3):
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
        return model
''')


def check(tmp_path: Path, module: str, source: str, attr: str = "make_model", *,
          prelude: str = PRELUDE, only: str | None = None, **flags: str) -> CheckReport:
    """``tyingspec check module:attr --kind torch`` on every standard case (``only``: on that
    one, for a model whose every case runs the forward check to its budget; ``flags``:
    ``autocast=``, ``compile=``, as the command line's)."""
    (tmp_path / f"{module}.py").write_text(prelude + textwrap.dedent(source))
    cases = [c for c in kind_spec("torch").cases(0) if only in (None, c.name)]
    assert cases
    for key, value in flags.items():
        cases = [c.with_setting(key, value) for c in cases]
    return check_target(f"{module}:{attr}", "torch", 0, cases, paths=(str(tmp_path),))


def shapes(rep: CheckReport) -> set[tuple[int, int]]:
    """(sequences, positions) of every case the report ran (its torch setting)."""
    from tyingspec._src.kinds.torch.setting import parse

    return {(parse(r.case.setting).B, parse(r.case.setting).T) for r in rep.results}


def summary(rep: CheckReport) -> str:
    """The report's verdict and every finding that did not pass, for an assertion message."""
    lines = [f"exit {rep.exit_code} {rep.diagnosis_label}; load_error={rep.load_error!r}",
             *rep.notes]
    for r in rep.results:
        lines.append(f"case {r.case.name} N={r.case.N}: {r.status} "
                     f"{r.diagnosis.headline() if r.diagnosis else ''} {r.error or ''}")
        for f in r.diagnosis.findings if r.diagnosis else ():
            # the identity checks a model without tie_weights() cannot run are noise here
            if f.outcome == "failed" or (f.outcome != "passed"
                                         and not f.check.startswith("identity after")):
                lines.append(f"    {f.check}: {f.outcome} {f.label or ''} | {f.detail}")
    return "\n".join(lines)
