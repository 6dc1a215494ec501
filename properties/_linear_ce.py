"""The linear-ce kind's properties: a fused linear-cross-entropy kernel as the tied head.

Cases draw the kernel's options (each on or off, every reduction, class weights, ignored tokens
including a whole chunk and the whole batch, one target everywhere), the shapes that break
chunked kernels (N and V off any block size, N past two blocks of 1024) and bfloat16 for a
kernel whose low-precision branch is its own.  A case needing an option the kernel does not
declare is discarded: an unsupported option is never run as if it were off.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tyingspec._src.core.cases import Case
from tyingspec._src.engine.observe import Observation, Target, described, observe, runnable
from tyingspec._src.kinds.linear_ce.kind import restricted

from ._core import PropertyFailure, discard, register, require_rows


@st.composite
def ce_cases(draw: st.DrawFn) -> Case:
    """A kernel call: shape, composition, options and a seed."""
    V = draw(st.integers(2, 40))
    d = draw(st.integers(1, 6))
    # mostly short batches; one in four past two blocks of 1024 tokens (real kernels' blocks
    # are hundreds to thousands of rows: `dE = block_dE` for `+=` shows only past one)
    N = draw(st.integers(2049, 2100)) if draw(st.integers(0, 3)) == 0 else \
        draw(st.integers(1, 30))
    parts: list[str] = []
    if draw(st.booleans()):
        parts.append(f"logit_scale={draw(st.sampled_from((0.0625, 0.5, 2.0)))}")
    if draw(st.booleans()):
        parts.append(f"softcap={draw(st.sampled_from((1.5, 5.0)))}")
    if draw(st.booleans()):
        parts.append(f"label_smoothing={draw(st.sampled_from((0.05, 0.3)))}")
    if draw(st.booleans()):
        parts.append("lse_square_scale=0.01")
    reduction = draw(st.sampled_from(("mean", "sum", "none")))
    if reduction != "mean":
        parts.append(f"reduction={reduction}")
    if draw(st.booleans()):
        parts.append(f"ignored={draw(st.sampled_from((0.2, 0.5, 1)))}")
    if draw(st.booleans()):
        parts.append("ce_weight=drawn")
    if draw(st.integers(0, 5)) == 0:
        parts.append("target=same")
    e_scale = draw(st.sampled_from((0.5, 1.0, 2.0)))
    res = draw(st.sampled_from((0.0, 1.0)))
    # bfloat16 for a kernel that declares it (a low-precision branch of its own); float32
    # for one that does not (see restricted)
    dtype = draw(st.sampled_from(("float64", "float64", "float32", "bfloat16")))
    if draw(st.integers(0, 5)) == 0:
        # logits near 1e4 in float32 (h = x + tanh(x W) ~ E's rows): a logsumexp without the
        # max shift overflows there
        parts.append("logits=1e4")
        e_scale, res, dtype = float(np.sqrt(1e4 / d)), 1.0, "float32"
    return Case(name="drawn-ce", V=V, d=d, N=N, seed=draw(st.integers(0, 2**32 - 1)),
                composition=draw(st.sampled_from(("random", "repeats", "one-token"))),
                distinct=draw(st.integers(1, max(1, min(V, N)))),
                bias=draw(st.booleans()), e_scale=e_scale, res=res, ce=",".join(parts),
                dtype=dtype)


def _observed(target: Target, case: Case) -> Observation:
    # drawn over the options the kernel declares only: the others are taken out of the case
    # (never run as off while the case says on); the replay shows the case as run
    case = restricted(case, described(target).get("options", ()))
    why = runnable(target, case)
    if why is not None:  # not reached for a kernel that describes itself; kept as a guard
        discard(f"the kernel {why}")
    return observe(target, case)


@register("ce_kernel_outputs", "SCALE", ce_cases)
def ce_kernel_outputs(target: Target, case: Case) -> None:
    """The kernel's loss, dh, dE and db are the linear cross-entropy's under its options, within
    the rounding bound; a mismatch is named by the known bug it matches (logit scale dropped or
    doubled, softcap derivative missing, label smoothing mis-weighted, z-loss missing, ignored
    tokens counted or not zeroed, grad_output broadcast) or by the output that is wrong."""
    o = _observed(target, case)
    f = next((f for f in o.diagnosis.findings if f.failed), None)
    if f is not None and f.label == "no_power":
        # a low-precision draw whose bound a known bug's error fits in: no evidence either way
        discard(f"{f.check}: {f.detail}")
    if f is not None:
        raise PropertyFailure("ce_kernel_outputs", f"{f.check}: {f.invariant} does not hold",
                              o.case, diagnosis=o.diagnosis)


@register("ce_tie_is_the_sum_of_paths", "SUM", ce_cases)
def ce_tie_is_the_sum_of_paths(target: Target, case: Case) -> None:
    """With the kernel as the probe model's head, the tied gradient (the kernel's dE plus the
    scatter-add of the input path its dh implies) is the reference's two paths, row by row."""
    require_rows("ce_tie_is_the_sum_of_paths", _observed(target, case))
