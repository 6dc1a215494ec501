"""A model adapter in torch: the probe model, differentiated by autograd.

    tyingspec check examples.torch_model.grads:tied_backward

tyingspec passes numpy copies; torch tensors are accepted as returned values.
"""

import torch


def tied_backward(E, W, b, tokens, targets, *, res, s_in):
    E_t = torch.tensor(E, requires_grad=True)
    W_t = torch.tensor(W, requires_grad=True)
    b_t = None if b is None else torch.tensor(b, requires_grad=True)
    x = s_in * E_t[torch.as_tensor(tokens).reshape(-1)]
    h = res * x + torch.tanh(x @ W_t)
    logits = h @ E_t.T + (0 if b_t is None else b_t)
    loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(targets).reshape(-1))
    loss.backward()
    return {"loss": loss, "dE": E_t.grad, "dW": W_t.grad, "db": None if b_t is None else b_t.grad}
