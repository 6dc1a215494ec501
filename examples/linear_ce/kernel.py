"""A linear-cross-entropy kernel under ``--kind linear-ce`` (numpy function form).

    tyingspec check examples.linear_ce.kernel:linear_ce --kind linear-ce

``h [N, d]`` are the hidden states, ``E [V, d]`` the tied matrix, ``targets [N]``.  The keyword
parameters are the options the kernel supports: here ``ignore_index`` and the ``mean`` and
``sum`` reductions.  Cases that set an option it does not declare (a softcap, label smoothing,
a bias, ...) are left out with a note, never run as if the option were off.
"""

from typing import Literal

import numpy as np


def linear_ce(h, E, targets, *, ignore_index=-100,
              reduction: Literal["mean", "sum"] = "mean"):
    y = np.asarray(targets).reshape(-1)
    keep = y != ignore_index
    y = np.where(keep, y, 0)                      # an ignored target may be -100: index 0
    rows = np.arange(len(y))
    z = h @ E.T
    z = z - z.max(axis=1, keepdims=True)          # finite at logits near 1e4 in float32
    se = np.exp(z).sum(axis=1)
    per_token = np.log(se) - z[rows, y]           # lse - z[target]
    if reduction == "sum":
        scale = 1.0
    else:                                         # mean over kept tokens; none kept: 0
        scale = 1.0 / keep.sum() if keep.any() else 0.0
    g = np.exp(z) / se[:, None]
    g[rows, y] -= 1
    g *= np.where(keep, scale, 0.0).astype(g.dtype)[:, None]   # dL/dlogits; ignored weigh 0
    loss = float(np.where(keep, per_token, 0).sum() * scale)
    return {"loss": loss, "dh": g @ E, "dE": g.T @ h, "db": None}
