"""A kind is its ``KindSpec``: what the front ends used to decide by a kind's name (what it
needs installed, its ignored target, its memory, whether its reference comes first) is read
from the spec, and the table line that names the spec agrees with it."""

from __future__ import annotations

import numpy as np
import pytest

from tyingspec._src.core.cases import memory_problem, model_bytes
from tyingspec._src.core.tolerance import epsilon_of, smallest_normal
from tyingspec._src.kinds.table import _LINES, DEFAULT_KIND, KIND_NAMES, KINDS, _Table, needs


@pytest.mark.parametrize("name", ["float64", "float32", "float16"])
def test_epsilon_and_smallest_normal_are_numpys_finfo(name: str) -> None:
    # the values a kind used to read from its framework's finfo, now core.tolerance's rule
    info = np.finfo(name)
    assert epsilon_of(name) == float(info.eps) == epsilon_of(np.dtype(name))
    assert smallest_normal(name) == float(info.tiny)


def test_bfloat16s_epsilon_and_smallest_normal() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    info = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert epsilon_of("bfloat16") == float(info.eps) and smallest_normal("bfloat16") == float(
        info.tiny)


def test_each_table_line_says_what_its_spec_needs() -> None:
    # the plugin reads `needs` from the line in xdist's controller (no numpy there)
    assert {k: needs(k) for k in KIND_NAMES} == {k: KINDS[k].needs for k in KIND_NAMES}
    assert needs("torch") == "torch" and needs("jax") == "jax" and needs("model") is None


def test_a_line_that_disagrees_with_its_spec_is_refused() -> None:
    line = _LINES["model"].split()[0] + "  needs torch"
    with pytest.raises(TypeError, match="needs another module"):
        _Table({"model": line})["model"]


def test_the_decisions_that_were_kind_names_are_spec_fields() -> None:
    assert DEFAULT_KIND == KIND_NAMES[0] and KINDS[DEFAULT_KIND].no_padding_flag is None
    assert all(KINDS[k].no_padding_flag for k in KIND_NAMES if k != DEFAULT_KIND)
    assert [k for k in KIND_NAMES if KINDS[k].ignore_index() is not None] == ["linear-ce"]
    assert KINDS["linear-ce"].ignore_index("ignored=0.25,ignore_index=7") == 7
    assert KINDS["linear-ce"].ignore_index() == -100
    assert [k for k in KIND_NAMES if KINDS[k].reference_first] == ["model", "kernel"]
    assert [k for k in KIND_NAMES if KINDS[k].options_problem is not None] == ["linear-ce"]
    assert [k for k in KIND_NAMES if KINDS[k].quick_checks] == ["torch"]


def test_a_kinds_memory_estimate_is_its_own() -> None:
    V, d, N = 128256, 4096, 1024
    model, kernel, ce = (KINDS[k].peak_bytes(V, d, N, "float32")
                         for k in ("model", "kernel", "linear-ce"))
    assert model == model_bytes(V, d, N) and kernel < model and kernel < ce
    problem = memory_problem(V, d, N, 1 << 30, "float32", KINDS["linear-ce"])
    assert problem is not None and "for a linear-ce check" in problem
    assert "for a model check" in str(memory_problem(V, d, N, 1 << 30))


def test_a_built_in_can_need_more_than_its_kind() -> None:
    from tyingspec._src.kinds.linear_ce.zoo import LINEAR_CE_BUILTINS

    spec = KINDS["linear-ce"]
    assert spec.builtin_needs is not None
    forms = {spec.builtin_needs(n) for n in LINEAR_CE_BUILTINS}
    assert forms == {None, "torch"}, forms
