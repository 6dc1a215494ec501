"""Bugs outside tyingspec's catalogue, written the way users write them (numpy model adapters,
``f(E, W, b, tokens, targets, *, res, s_in)``).  No catalogue label's pattern explains their
wrong rows, so the honest verdict names only what the rows show
(``tests/core/test_out_of_catalogue.py`` holds ``tyingspec check`` and the pytest plugin to it)."""
import numpy as np


def _fwd(E, W, b, tokens, targets, res, s_in):
    t = np.asarray(tokens).reshape(-1)
    y = np.asarray(targets).reshape(-1)
    N = t.shape[0]
    x = s_in * E[t]
    a = np.tanh(x @ W)
    h = res * x + a
    logits = h @ E.T + (0 if b is None else b)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(np.mean(-np.log(p[np.arange(N), y])))
    g = p.copy()
    g[np.arange(N), y] -= 1
    g /= N
    dh = g @ E
    du = dh * (1 - a * a)
    return t, y, x, h, g, dh, du, loss


def _out(E, W, b, x, du, g, loss, dE):
    return {"loss": loss, "dE": dE, "dW": x.T @ du, "db": None if b is None else g.sum(0)}


def scatter_into_targets(E, W, b, tokens, targets, *, res, s_in):
    t, y, x, h, g, dh, du, loss = _fwd(E, W, b, tokens, targets, res, s_in)
    dx = res * dh + du @ W.T
    dE = g.T @ h
    np.add.at(dE, y, s_in * dx)          # the bug: the targets' rows, not the tokens'
    return _out(E, W, b, x, du, g, loss, dE)


def dx_missing_du_term(E, W, b, tokens, targets, *, res, s_in):
    t, y, x, h, g, dh, du, loss = _fwd(E, W, b, tokens, targets, res, s_in)
    dx = res * dh                         # the bug: "+ du @ W.T" forgotten
    dE = g.T @ h
    np.add.at(dE, t, s_in * dx)
    return _out(E, W, b, x, du, g, loss, dE)


def llmc_overwrite(E, W, b, tokens, targets, *, res, s_in):
    t, y, x, h, g, dh, du, loss = _fwd(E, W, b, tokens, targets, res, s_in)
    dx = res * dh + du @ W.T
    dE = g.T @ h                          # llm.c: matmul backward into dwte first ...
    for i, ix in enumerate(t):
        dE[ix] = s_in * dx[i]             # ... then encoder_backward: dwte[ix] = d (not +=)
    return _out(E, W, b, x, du, g, loss, dE)
