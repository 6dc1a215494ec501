"""The torch kind on every torch the extras admit: the observer binds ``Function.apply``
through the descriptor protocol (a Python ``classmethod`` in torch 2.13, a C
``classmethod_descriptor`` in 2.14), and a torch whose ``apply`` is neither is named with its
version as an adapter error, never a traceback.  CI runs this file, like every torch test, on
2.13.0 and on the newest torch pip installs (``.ci/run``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.autograd.function import Function

from tyingspec._src.core.adapters import AdapterError
from tyingspec._src.kinds.torch import zoo
from tyingspec._src.kinds.torch.adapter import call_torch
from tyingspec._src.kinds.torch.uses import observed_uses


class _Lookup(Function):
    @staticmethod
    def forward(ctx: Any, E: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.V = E.shape[0]
        return E[ids]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        return torch.zeros(ctx.V, g.shape[-1], dtype=g.dtype).index_add_(0, ids, g), None


def test_a_custom_functions_lookup_is_observed_on_this_torch() -> None:
    E = torch.randn(5, 3, requires_grad=True)
    ids = torch.tensor([1, 2, 1])
    before = Function.__dict__["apply"]
    with observed_uses(E) as uses:
        out = _Lookup.apply(E, ids)
    out.sum().backward()
    assert Function.__dict__["apply"] is before  # put back as it was, whatever its type
    assert [u["ids"].tolist() for u in uses.lookups] == [[1, 2, 1]]
    assert uses.lookups[0]["dx"] is not None and uses.problem() == "no head use of the tied " \
        "weight was seen"
    assert torch.equal(E.grad, torch.zeros(5, 3).index_add_(0, ids, torch.ones(3, 3)))


class _NoDescriptor:
    """What a future torch might keep as ``Function.apply``: callable, but no descriptor."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never bound
        raise AssertionError("called unbound")


@pytest.fixture
def apply_without_descriptor() -> Iterator[None]:
    original = Function.__dict__["apply"]
    Function.apply = _NoDescriptor()  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        Function.apply = original  # type: ignore[method-assign]


def test_a_torch_whose_apply_cannot_be_bound_is_an_adapter_error_naming_its_version(
        apply_without_descriptor: None) -> None:
    nanogpt = getattr(zoo, zoo.TORCH_BUILTINS["nanogpt"].attr)
    with pytest.raises(AdapterError) as info:
        call_torch("nanogpt", nanogpt, {"tokens": [[1, 2, 3, 1]] * 2,
                                        "targets": [[2, 3, 1, 0]] * 2, "checks": ()})
    text = str(info.value)
    assert "cannot be checked on this torch" in text
    assert f"torch {torch.__version__}" in text and "_NoDescriptor" in text
