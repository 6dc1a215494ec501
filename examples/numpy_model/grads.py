"""A model adapter in numpy: the probe model's forward and its hand-written backward.

    tyingspec check examples.numpy_model.grads:tied_backward

The tied matrix E is used twice, so its gradient is the sum of two paths: the scatter-add of
dx into the rows of the batch's tokens (input path; repeated tokens add) and g.T @ h (output
path).  Replace ``np.add.at(dE, tokens, s_in * dx)`` with ``dE[tokens] += s_in * dx`` (numpy's
buffered fancy-index add) and the check exits 1 with ``duplicates_not_accumulated``.
"""

import numpy as np


def tied_backward(E, W, b, tokens, targets, *, res, s_in):
    tokens, targets = np.asarray(tokens).reshape(-1), np.asarray(targets).reshape(-1)
    N = tokens.shape[0]
    # forward: x = s_in * E[tokens]; h = res * x + tanh(x @ W); logits = h @ E.T (+ b)
    x = s_in * E[tokens]
    t = np.tanh(x @ W)
    h = res * x + t
    logits = h @ E.T + (0 if b is None else b)
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(N), targets]).mean()
    # backward
    g = p.copy()
    g[np.arange(N), targets] -= 1
    g /= N                                    # dL/dlogits
    dh = g @ E
    du = dh * (1 - t * t)
    dx = res * dh + du @ W.T
    dE = g.T @ h                              # output path
    np.add.at(dE, tokens, s_in * dx)          # input path: repeated tokens add
    return {"loss": loss, "dE": dE, "dW": x.T @ du, "db": None if b is None else g.sum(axis=0)}
