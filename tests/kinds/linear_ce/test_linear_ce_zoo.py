"""The built-in linear-ce implementations, checked with plain numpy and torch (not tyingspec's
checker).

The correct ones must agree with each other and with torch autograd of a straightforward,
unchunked implementation of the contract (``reference`` below, itself pinned against
``F.cross_entropy`` where their semantics coincide), over the options, the reductions and
awkward batches; each mutant must differ from the correct one in exactly the way its
description says on its ``exposes`` case, and agree with it where its bug cannot show.
"""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from tyingspec._src.kinds.linear_ce import zoo as zoo  # noqa: E402
from tyingspec._src.kinds.linear_ce.zoo import (  # noqa: E402
    CHUNK,
    LINEAR_CE_BUILTINS,
    builtin_target,
    ce_numpy,
    ce_torch,
)

OPTIONS = ("logit_scale", "softcap", "label_smoothing", "lse_square_scale", "ignore_index",
           "reduction", "ce_weight")
# float64: chunked vs unchunked, hand-derived vs autograd differ by a few roundings of entries
# of size 1e-3..10
RTOL64, ATOL64 = 1e-10, 1e-12
# float32 against the float64 reference: a few float32 roundings (eps 1.2e-7) of logits and
# lse of a few units, accumulated over d and N
RTOL32, ATOL32 = 2e-4, 2e-5


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@dataclass(frozen=True)
class Batch:
    """One batch in float64: h [N, d], E [V, d], targets, b [V] or None, grad_output [N]."""

    h: np.ndarray
    E: np.ndarray
    y: np.ndarray
    b: np.ndarray | None
    go: np.ndarray
    w: np.ndarray  # a ce_weight, used when the options ask for one
    ignore_index: int = -100

    @property
    def N(self) -> int:
        return int(self.h.shape[0])

    @property
    def V(self) -> int:
        return int(self.E.shape[0])


def make_batch(N: int, V: int, d: int, *, seed: int, ignored: list[int] | None = None,
               ignore_index: int = -100, target: int | None = None, bias: bool = True,
               magnitude: float = 1.0) -> Batch:
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, d))
    E = rng.normal(size=(V, d)) / np.sqrt(d) * 2  # logits of a few units
    if magnitude != 1.0:
        k = np.sqrt(magnitude / np.abs(h @ E.T).max())
        h, E = h * k, E * k
    y = np.full(N, target) if target is not None else rng.integers(0, V, N)
    if ignore_index in range(V):
        y[y == ignore_index] = (ignore_index + 1) % V  # only the rows below are ignored
    y[ignored or []] = ignore_index
    b = rng.normal(size=V) if bias else None
    go = rng.uniform(-1.0, 2.0, N)  # non-uniform, some negative
    w = rng.uniform(0.2, 2.0, V)
    return Batch(h, E, y, b, go, w, ignore_index)


# N and V mostly not multiples of CHUNK; a fully ignored chunk; ignore_index negative, in range
# and past V; one target everywhere; V = 1; N < CHUNK; everything ignored
BATCHES = {
    "mixed": make_batch(17, 11, 5, seed=1, ignored=[2, 7, 8, 9, 10, 11, 12, 13]),
    "multiple": make_batch(14, 14, 4, seed=2, ignored=[0, 13], ignore_index=3),
    "one-target": make_batch(15, 9, 6, seed=3, ignored=[5, 6], ignore_index=9, target=4),
    "tiny": make_batch(3, 1, 2, seed=4, ignored=[1], target=0),
    "all-ignored": make_batch(10, 8, 3, seed=5, ignored=list(range(10))),
}
assert CHUNK == 7 and BATCHES["mixed"].y[7:14].tolist() == [-100] * 7


def ghost(x: Tensor) -> Tensor:
    """Zero in value, ``x``'s gradient: puts a mutant's extra backward term into a reference."""
    return x - x.detach()


def reference(batch: Batch, opts: dict[str, Any], *, variant: str | None = None,
              go: np.ndarray | None = None, dtype: torch.dtype = torch.float64
              ) -> dict[str, Any]:
    """Autograd of the contract written out unchunked; ``variant`` replays one mutant's slip."""
    s = opts.get("logit_scale", 1.0)
    c = opts.get("softcap")
    eps = opts.get("label_smoothing", 0.0)
    lam = opts.get("lse_square_scale", 0.0)
    reduction = opts.get("reduction", "mean")
    h = torch.tensor(batch.h, dtype=dtype, requires_grad=True)
    E = torch.tensor(batch.E, dtype=dtype, requires_grad=True)
    b = None if batch.b is None else torch.tensor(batch.b, dtype=dtype, requires_grad=True)
    u = h @ E.T + (0 if b is None else b)
    u.retain_grad()
    a = s * u
    z = a if c is None else c * torch.tanh(a / c)
    if variant == "softcap_derivative_missing":
        z = a + (z - a).detach()
    y = torch.tensor(batch.y)
    valid = y != batch.ignore_index
    y0 = torch.where(valid, y, 0)
    lse = torch.logsumexp(z, dim=1)
    zy = z[torch.arange(batch.N), y0]
    zloss = lam * lse**2
    if variant == "z_loss_missing":
        zloss = zloss.detach()
    loss = lse - (1 - eps) * zy - eps * z.mean(dim=1) + zloss
    if variant == "smoothing_misweighted":
        loss = loss + ghost(-eps * zy)
    w = (torch.ones(batch.V, dtype=dtype) if opts.get("ce_weight") is None
         else torch.as_tensor(opts["ce_weight"], dtype=dtype))
    t = torch.where(valid, w[y0], 0)
    D = t.sum()
    if variant == "ignored_counted":
        D = D + (~valid).sum()
    g = torch.tensor(go if go is not None else batch.go, dtype=dtype)
    if reduction == "mean":
        L = (t * loss).sum() / D if D > 0 else (t * loss).sum() * 0
        norm = torch.full((batch.N,), 1 / float(D) if D > 0 else 0.0, dtype=dtype)
        J = L
    elif reduction == "sum":
        L = J = (t * loss).sum()
        norm = torch.ones(batch.N, dtype=dtype)
    else:
        L = t * loss
        J = (g * L).sum()
        norm = g
    if variant == "ignored_not_zeroed":
        J = J + ghost((torch.where(valid, 0, norm) * lse).sum())
    J.backward(retain_graph=variant == "bias_grad_wrong")
    out = {"loss": L.detach().numpy(), "dh": h.grad.numpy(), "dE": E.grad.numpy(),
           "db": None if b is None else b.grad.numpy(), "G": u.grad.numpy()}
    if variant == "bias_grad_wrong" and b is not None:
        # every row's loss at its safe target, weighted by the reduction's factor but not t_i
        b.grad = None
        (norm.detach() * loss).sum().backward()
        out["db"] = b.grad.numpy()
    return out


def numpy_opts(batch: Batch, opts: dict[str, Any]) -> dict[str, Any]:
    kw = {k: v for k, v in opts.items() if k != "ce_weight"}
    if opts.get("ce_weight") is not None:
        kw["ce_weight"] = opts["ce_weight"]
    return kw | {"ignore_index": batch.ignore_index}


def run_numpy(fn: Any, batch: Batch, opts: dict[str, Any], *, dtype: Any = np.float64,
              go: np.ndarray | None = None) -> dict[str, Any]:
    def cast(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x, dtype)

    kw = numpy_opts(batch, opts)
    if "ce_weight" in kw:
        kw["ce_weight"] = cast(kw["ce_weight"])
    if opts.get("reduction") == "none":
        kw["grad_output"] = cast(go if go is not None else batch.go)
    r = fn(cast(batch.h), cast(batch.E), batch.y, cast(batch.b), **kw)
    if opts.get("reduction", "mean") != "none":
        assert isinstance(r["loss"], float)
    else:
        assert r["loss"].shape == (batch.N,) and r["loss"].dtype == dtype
    for k in ("dh", "dE", "db"):
        assert r[k] is None or r[k].dtype == dtype, k
    assert (r["db"] is None) == (batch.b is None)
    return {k: np.asarray(v) if v is not None else None for k, v in r.items()}


def run_torch(factory: Any, batch: Batch, opts: dict[str, Any], *,
              dtype: torch.dtype = torch.float64, go: np.ndarray | None = None
              ) -> dict[str, Any]:
    kw = dict(opts)
    if kw.get("ce_weight") is not None:
        kw["ce_weight"] = torch.as_tensor(kw["ce_weight"], dtype=dtype)
    loss_fn = factory(ignore_index=batch.ignore_index, **kw)
    h = torch.tensor(batch.h, dtype=dtype, requires_grad=True)
    E = torch.tensor(batch.E, dtype=dtype, requires_grad=True)
    b = None if batch.b is None else torch.tensor(batch.b, dtype=dtype, requires_grad=True)
    loss = loss_fn(E, h, torch.tensor(batch.y), b)
    assert loss.dtype == dtype
    if opts.get("reduction") == "none":
        assert loss.shape == (batch.N,)
        loss.backward(torch.tensor(go if go is not None else batch.go, dtype=dtype))
    else:
        assert loss.shape == ()
        loss.backward()
    def out(t: Tensor) -> np.ndarray:
        # numpy has no bfloat16: half-precision results are read as float64 (exactly)
        t = t.detach()
        return (t.double() if dtype in (torch.bfloat16, torch.float16) else t).numpy()

    return {"loss": out(loss), "dh": out(h.grad), "dE": out(E.grad),
            "db": None if b is None else out(b.grad)}


def close(actual: dict[str, Any], expected: dict[str, Any], *, keys: tuple[str, ...] = (
        "loss", "dh", "dE", "db"), rtol: float = RTOL64, atol: float = ATOL64) -> None:
    for k in keys:
        if expected[k] is None:
            assert actual[k] is None, k
            continue
        np.testing.assert_allclose(actual[k], expected[k], rtol=rtol, atol=atol, err_msg=k)


def far(actual: np.ndarray, expected: np.ndarray) -> None:
    """Different by far more than rounding (1e-4 relative to the larger entries)."""
    scale = max(float(np.abs(expected).max()), 1e-3)
    assert float(np.abs(np.asarray(actual) - expected).max()) > 1e-4 * scale


def option_grid(batch: Batch, reduction: str) -> Iterator[dict[str, Any]]:
    for s, c, eps, lam, weighted in itertools.product(
            (1.0, 0.0625), (None, 2.0), (0.0, 0.1), (0.0, 0.01), (False, True)):
        opts: dict[str, Any] = {"logit_scale": s, "softcap": c, "label_smoothing": eps,
                                "lse_square_scale": lam, "reduction": reduction}
        if weighted:
            opts["ce_weight"] = batch.w
        yield opts


# --- the reference itself --------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["mixed", "multiple", "one-target"])
def test_reference_is_torch_cross_entropy(name: str, reduction: str) -> None:
    # where the contract and F.cross_entropy coincide (no softcap or z-loss; F weights the
    # smoothing term per class, so not with both ce_weight and smoothing)
    batch = BATCHES[name]
    for s, eps, weighted in [(1.0, 0.0, False), (0.0625, 0.1, False), (0.5, 0.0, True)]:
        opts: dict[str, Any] = {"logit_scale": s, "label_smoothing": eps,
                                "reduction": reduction}
        if weighted:
            opts["ce_weight"] = batch.w
        ours = reference(batch, opts)
        h = torch.tensor(batch.h, requires_grad=True)
        E = torch.tensor(batch.E, requires_grad=True)
        b = torch.tensor(batch.b, requires_grad=True)
        L = F.cross_entropy(s * (h @ E.T + b), torch.tensor(batch.y),
                            weight=torch.tensor(batch.w) if weighted else None,
                            ignore_index=batch.ignore_index, reduction=reduction,
                            label_smoothing=eps)
        (L * torch.tensor(batch.go) if reduction == "none" else L).sum().backward()
        theirs = {"loss": L.detach().numpy(), "dh": h.grad.numpy(), "dE": E.grad.numpy(),
                  "db": b.grad.numpy()}
        close(ours, theirs)


# --- the correct built-ins -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_correct_float64(name: str, reduction: str) -> None:
    """ce-numpy, ce-torch (and the fused Function with its slip off) equal the reference."""
    for with_bias in (True, False):
        batch = BATCHES[name] if with_bias else replace(BATCHES[name], b=None)
        for opts in option_grid(batch, reduction):
            ref = reference(batch, opts)
            got_np = run_numpy(ce_numpy, batch, opts)
            got_t = run_torch(ce_torch, batch, opts)
            close(got_np, ref)
            close(got_t, ref)
            close(got_np, got_t)
            if not opts["softcap"]:  # the fused Function once per batch is plenty
                close(run_torch(zoo._ce_torch_fused, batch, opts), ref)
            if name == "all-ignored":
                for k in ("loss", "dh", "dE"):
                    assert not np.any(got_np[k]) and not np.any(got_t[k]), k


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["mixed", "multiple", "one-target", "all-ignored"])
def test_correct_float32(name: str, reduction: str) -> None:
    batch = BATCHES[name]
    for opts in option_grid(batch, reduction):
        ref = reference(batch, opts)
        close(run_numpy(ce_numpy, batch, opts, dtype=np.float32), ref,
              rtol=RTOL32, atol=ATOL32)
        close(run_torch(ce_torch, batch, opts, dtype=torch.float32), ref,
              rtol=RTOL32, atol=ATOL32)


def test_scalar_grad_output_and_default_none_grad_output() -> None:
    batch = BATCHES["mixed"]
    for reduction in ("mean", "sum"):
        plain = ce_numpy(batch.h, batch.E, batch.y, batch.b, reduction=reduction)
        scaled = ce_numpy(batch.h, batch.E, batch.y, batch.b, reduction=reduction,
                          grad_output=2.5)
        assert scaled["loss"] == plain["loss"]
        for k in ("dh", "dE", "db"):
            np.testing.assert_allclose(scaled[k], 2.5 * plain[k], rtol=RTOL64, atol=ATOL64)
    none = ce_numpy(batch.h, batch.E, batch.y, batch.b, reduction="none")
    total = ce_numpy(batch.h, batch.E, batch.y, batch.b, reduction="sum")
    assert np.isclose(none["loss"].sum(), total["loss"], rtol=RTOL64, atol=ATOL64)
    for k in ("dh", "dE", "db"):
        np.testing.assert_allclose(none[k], total[k], rtol=RTOL64, atol=ATOL64)


def test_correct_is_finite_at_large_logits_float32() -> None:
    batch = make_batch(17, 11, 5, seed=6, ignored=[3], magnitude=1e4)
    assert 5e3 < np.abs(batch.h @ batch.E.T).max() <= 1.0001e4
    for reduction in ("mean", "none"):
        opts = {"reduction": reduction, "lse_square_scale": 1e-4}
        ref = reference(batch, opts)
        for got in (run_numpy(ce_numpy, batch, opts, dtype=np.float32),
                    run_torch(ce_torch, batch, opts, dtype=torch.float32)):
            for k in ("loss", "dh", "dE", "db"):
                assert np.all(np.isfinite(got[k])), k
                # float32 roundings of logits of 1e4: absolute errors of ~1e-3 of the largest
                scale = float(np.abs(ref[k]).max())
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-5 * scale,
                                           err_msg=k)


# --- the mutants -----------------------------------------------------------------------------

def exposes_batch(exposes: dict[str, object]) -> Batch:
    """A batch (with b) in the spirit of the checker's case for ``exposes``."""
    N = 17
    fraction = float(exposes.get("ignored_fraction", 0.0))  # type: ignore[arg-type]
    ignored = list(range(1, N, round(1 / fraction))) if fraction else []
    return make_batch(N, 13, 6, seed=7, ignored=ignored,
                      magnitude=float(exposes.get("logit_magnitude", 1.0)))  # type: ignore[arg-type]


def exposes_opts(exposes: dict[str, object]) -> dict[str, Any]:
    return {k: v for k, v in exposes.items() if k in OPTIONS}


def run(name: str, batch: Batch, opts: dict[str, Any], **kw: Any) -> dict[str, Any]:
    builtin = LINEAR_CE_BUILTINS[name]
    runner = run_numpy if builtin.form == "numpy" else run_torch
    return runner(builtin_target(name), batch, opts, **kw)


def correct(form: str, batch: Batch, opts: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return run("ce-numpy" if form == "numpy" else "ce-torch", batch, opts, **kw)


MUTANTS = [n for n, b in LINEAR_CE_BUILTINS.items() if b.expected != "correct"]
ALL_ON: dict[str, Any] = {"logit_scale": 0.5, "softcap": 3.0, "label_smoothing": 0.05,
                          "lse_square_scale": 0.02}


def test_catalogue() -> None:
    assert {n for n, b in LINEAR_CE_BUILTINS.items() if b.expected == "correct"} == {
        "ce-numpy", "ce-torch"}
    assert len(MUTANTS) == 16
    numpy_params = list(inspect.signature(ce_numpy).parameters)
    torch_params = list(inspect.signature(ce_torch).parameters)
    assert numpy_params == ["h", "E", "targets", "b", "grad_output", *sorted(
        OPTIONS, key=numpy_params.index)]
    assert torch_params == ["ignore_index", "lse_square_scale", "label_smoothing",
                            "reduction", "softcap", "ce_weight", "logit_scale"]
    for name, b in LINEAR_CE_BUILTINS.items():
        assert b.name == name and b.attr == name.replace("-", "_")
        assert (b.breaks is None) == (b.expected == "correct")
        assert b.description and getattr(zoo, b.attr).__doc__
        assert set(b.exposes) <= {*OPTIONS, "ignored_fraction", "bias", "logit_magnitude",
                                  "tokens", "dtype"}
        params = inspect.signature(builtin_target(name)).parameters
        # every mutant supports every option, so a checker may try the one that exposes it
        assert list(params) == (numpy_params if b.form == "numpy" else torch_params), name
    with pytest.raises(KeyError):
        builtin_target("nope")


def test_importing_the_zoo_does_not_import_torch() -> None:
    code = ("import sys, tyingspec._src.kinds.linear_ce.zoo as z; z.builtin_target('ce-torch'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scale_dropped_and_twice() -> None:
    for name, power in [("ce-scale-dropped", -1), ("ce-scale-twice", 1),
                        ("ce-torch-scale-dropped", -1)]:
        b = LINEAR_CE_BUILTINS[name]
        s = b.exposes["logit_scale"]
        assert s == 0.0625
        for reduction in ("mean", "none"):
            batch, opts = exposes_batch(b.exposes), exposes_opts(b.exposes) | {
                "reduction": reduction}
            good, bad = correct(b.form, batch, opts), run(name, batch, opts)
            close(bad, good, keys=("loss",))
            for k in ("dh", "dE", "db"):
                # scale-dropped: 16x too large; scale-twice: 16x too small
                np.testing.assert_allclose(bad[k], good[k] * s**power, rtol=RTOL64,
                                           atol=ATOL64, err_msg=f"{name} {k}")
        # s = 1: nothing to drop or double, with every other option on
        batch = BATCHES["mixed"]
        opts = ALL_ON | {"logit_scale": 1.0, "ce_weight": batch.w}
        close(run(name, batch, opts), correct(b.form, batch, opts))


@pytest.mark.parametrize("name, option, off", [
    ("ce-softcap-derivative-missing", "softcap", None),
    ("ce-smoothing-misweighted", "label_smoothing", 0.0),
    ("ce-z-loss-missing", "lse_square_scale", 0.0),
])
def test_option_backward_slips(name: str, option: str, off: Any) -> None:
    """The backward misses one option's term: loss right, gradients = the reference's with
    that term's gradient replayed the mutant's way; off, the mutant is correct."""
    b = LINEAR_CE_BUILTINS[name]
    assert option in b.exposes
    variant = name.removeprefix("ce-").replace("-", "_")
    for reduction in ("mean", "sum", "none"):
        batch, opts = exposes_batch(b.exposes), exposes_opts(b.exposes) | {
            "reduction": reduction}
        good, bad = correct("numpy", batch, opts), run(name, batch, opts)
        close(bad, good, keys=("loss",))
        close(bad, reference(batch, opts, variant=variant))
        for k in ("dh", "dE", "db"):
            far(bad[k], good[k])
    batch = BATCHES["mixed"]
    opts = ALL_ON | {option: off, "ce_weight": batch.w, "reduction": "none"}
    close(run(name, batch, opts), correct("numpy", batch, opts))


def test_ignored_counted() -> None:
    b = LINEAR_CE_BUILTINS["ce-ignored-counted"]
    batch, opts = exposes_batch(b.exposes), exposes_opts(b.exposes)
    n_ignored = int(np.sum(batch.y == batch.ignore_index))
    assert opts["reduction"] == "mean" and n_ignored == 4
    good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
    shrink = (batch.N - n_ignored) / batch.N  # sum of t_i over (sum of t_i + ignored)
    for k in ("loss", "dh", "dE", "db"):
        np.testing.assert_allclose(bad[k], good[k] * shrink, rtol=RTOL64, atol=ATOL64,
                                   err_msg=k)
    weighted = opts | {"ce_weight": batch.w}
    close(run(b.name, batch, weighted), reference(batch, weighted, variant="ignored_counted"))
    # nothing ignored, or no mean: correct
    for other, opts in [(exposes_batch({}), ALL_ON | {"ce_weight": batch.w}),
                        (batch, ALL_ON | {"reduction": "sum"}),
                        (batch, ALL_ON | {"reduction": "none"}),
                        (BATCHES["all-ignored"], ALL_ON)]:
        close(run(b.name, other, opts), correct("numpy", other, opts))


def test_ignored_not_zeroed() -> None:
    b = LINEAR_CE_BUILTINS["ce-ignored-not-zeroed"]
    batch = exposes_batch(b.exposes)
    for opts in [exposes_opts(b.exposes), ALL_ON | {"ce_weight": batch.w},
                 {"reduction": "none"}, {"reduction": "sum", "logit_scale": 0.5}]:
        good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
        close(bad, good, keys=("loss",))
        close(bad, reference(batch, opts, variant="ignored_not_zeroed"))
        for k in ("dh", "dE", "db"):
            far(bad[k], good[k])
        # the extra gradient sits on the ignored rows of dh only
        ignored = batch.y == batch.ignore_index
        close({"dh": bad["dh"][~ignored]}, {"dh": good["dh"][~ignored]}, keys=("dh",))
    for batch in (exposes_batch({}), BATCHES["all-ignored"]):
        opts = ALL_ON | {"ce_weight": batch.w}
        close(run(b.name, batch, opts), correct("numpy", batch, opts))


def test_grad_output_first() -> None:
    b = LINEAR_CE_BUILTINS["ce-grad-output-first"]
    assert b.form == "torch" and b.exposes == {"reduction": "none"}
    batch = exposes_batch(b.exposes)
    for opts in [exposes_opts(b.exposes), ALL_ON | {"reduction": "none"}]:
        good, bad = correct("torch", batch, opts), run(b.name, batch, opts)
        close(bad, good, keys=("loss",))
        # every row scaled by grad_output[0] instead of its own
        close(bad, reference(batch, opts, go=np.full(batch.N, batch.go[0])))
        for k in ("dh", "dE", "db"):
            far(bad[k], good[k])
    # a scalar grad_output, or a uniform one: correct
    for opts, go in [(ALL_ON | {"reduction": "mean"}, None), (ALL_ON | {"reduction": "sum"},
                     None), (ALL_ON | {"reduction": "none"}, np.full(batch.N, 0.7))]:
        close(run(b.name, batch, opts, go=go), correct("torch", batch, opts, go=go))


def test_dE_wrong() -> None:
    b = LINEAR_CE_BUILTINS["ce-dE-wrong"]
    for batch in (exposes_batch(b.exposes), BATCHES["mixed"], BATCHES["multiple"]):
        for opts in (exposes_opts(b.exposes), ALL_ON | {"reduction": "none"}):
            good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
            close(bad, good, keys=("loss", "dh", "db"))
            far(bad["dE"], good["dE"])
            # exactly: the last chunk's h met the previous chunk's logit gradient
            G = reference(batch, opts)["G"]
            last = CHUNK * ((batch.N - 1) // CHUNK)
            n = batch.N - last
            h_last, previous = batch.h[last:], G[last - CHUNK:last - CHUNK + n]
            expected = good["dE"] - G[last:].T @ h_last + previous.T @ h_last
            np.testing.assert_allclose(bad["dE"], expected, rtol=RTOL64, atol=ATOL64)
    # one chunk: the buffer is still zeros, so the whole output gradient is missing
    batch = make_batch(5, 6, 3, seed=8)
    bad = run(b.name, batch, {})
    assert not np.any(bad["dE"]) and np.any(correct("numpy", batch, {})["dE"])
    batch = BATCHES["all-ignored"]
    close(run(b.name, batch, ALL_ON), correct("numpy", batch, ALL_ON))


def test_dh_wrong() -> None:
    b = LINEAR_CE_BUILTINS["ce-dh-wrong"]
    # (not "tiny": with V = 1 and no z-loss every gradient is 0, dh included)
    for batch in (exposes_batch(b.exposes), BATCHES["multiple"], make_batch(5, 6, 3, seed=8)):
        for opts in (exposes_opts(b.exposes), ALL_ON | {"reduction": "sum"}):
            good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
            close(bad, good, keys=("loss", "dE", "db"))
            last = CHUNK * ((batch.N - 1) // CHUNK)
            np.testing.assert_allclose(bad["dh"][:last], good["dh"][:last], rtol=RTOL64,
                                       atol=ATOL64)
            assert not np.any(bad["dh"][last:])
            far(bad["dh"], good["dh"])
    # the last chunk all ignored: its dh is zero anyway
    batch = make_batch(16, 9, 4, seed=9, ignored=[14, 15])
    close(run(b.name, batch, ALL_ON), correct("numpy", batch, ALL_ON))


def test_bias_grad_wrong() -> None:
    b = LINEAR_CE_BUILTINS["ce-bias-grad-wrong"]
    assert b.exposes["bias"] is True
    batch = exposes_batch(b.exposes)
    for opts in (exposes_opts(b.exposes), ALL_ON | {"reduction": "none"},
                 {"ce_weight": batch.w, "reduction": "sum"}):
        good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
        close(bad, good, keys=("loss", "dh", "dE"))
        far(bad["db"], good["db"])
        close(bad, reference(batch, opts, variant="bias_grad_wrong"), keys=("db",))
    # no token ignored and no ce_weight: every t_i is 1; without b: no db to get wrong
    batch = exposes_batch({})
    close(run(b.name, batch, ALL_ON), correct("numpy", batch, ALL_ON))
    batch = replace(BATCHES["mixed"], b=None)
    opts = ALL_ON | {"ce_weight": batch.w}
    close(run(b.name, batch, opts), correct("numpy", batch, opts))


def test_overflow() -> None:
    b = LINEAR_CE_BUILTINS["ce-overflow"]
    batch = exposes_batch(b.exposes)
    assert 5e3 < np.abs(batch.h @ batch.E.T).max() <= 1.0001e4
    for opts in ({}, {"reduction": "none"}):
        bad = run(b.name, batch, opts, dtype=np.float32)
        good = correct("numpy", batch, opts, dtype=np.float32)
        assert not all(np.all(np.isfinite(bad[k])) for k in ("loss", "dh", "dE", "db"))
        assert all(np.all(np.isfinite(good[k])) for k in ("loss", "dh", "dE", "db"))
    # logits of a few units: exact
    batch = BATCHES["mixed"]
    for dtype in (np.float64, np.float32):
        opts = ALL_ON | {"ce_weight": batch.w}
        close(run(b.name, batch, opts, dtype=dtype), correct("numpy", batch, opts, dtype=dtype),
              rtol=1e-5 if dtype == np.float32 else RTOL64,
              atol=1e-6 if dtype == np.float32 else ATOL64)


def test_every_mutant_is_tested() -> None:
    tested = {"ce-scale-dropped", "ce-scale-twice", "ce-torch-scale-dropped",
              "ce-softcap-derivative-missing", "ce-smoothing-misweighted", "ce-z-loss-missing",
              "ce-ignored-counted", "ce-ignored-not-zeroed", "ce-grad-output-first",
              "ce-dE-wrong", "ce-dh-wrong", "ce-bias-grad-wrong", "ce-overflow",
              "ce-block-overwritten", "ce-torch-half-unmasked", "ce-ignore-index-hard-coded"}
    assert tested == set(MUTANTS)


def test_block_overwritten() -> None:
    """Right up to one block of BLOCK tokens; past it dE is the last block's alone."""
    b = LINEAR_CE_BUILTINS["ce-block-overwritten"]
    assert zoo.BLOCK == 1024 and b.exposes["tokens"] > 2 * zoo.BLOCK
    for N in (17, zoo.BLOCK):
        batch = make_batch(N, 9, 4, seed=10, ignored=[1, 5])
        opts = ALL_ON | {"ce_weight": batch.w}
        close(run(b.name, batch, opts), correct("numpy", batch, opts))
    for N in (zoo.BLOCK + 1, 2 * zoo.BLOCK + 453):
        batch = make_batch(N, 9, 4, seed=11, ignored=list(range(0, N, 5)))
        for opts in ({}, ALL_ON | {"reduction": "none"}):
            good, bad = correct("numpy", batch, opts), run(b.name, batch, opts)
            close(bad, good, keys=("loss", "dh", "db"))
            G = reference(batch, opts)["G"]
            last = zoo.BLOCK * ((N - 1) // zoo.BLOCK)
            np.testing.assert_allclose(bad["dE"], G[last:].T @ batch.h[last:], rtol=RTOL64,
                                       atol=ATOL64)
            far(bad["dE"], good["dE"])


def test_the_correct_kernels_are_right_past_several_blocks() -> None:
    """The block walk (numpy) and the growing chunks (torch) change no result."""
    batch = make_batch(3 * zoo.BLOCK + 77, 7, 3, seed=12, ignored=list(range(0, 3149, 3)))
    assert zoo.chunk_rows(batch.N) > CHUNK
    for opts in ({}, ALL_ON | {"ce_weight": batch.w, "reduction": "none"}):
        ref = reference(batch, opts)
        close(run_numpy(ce_numpy, batch, opts), ref)
        close(run_torch(ce_torch, batch, opts), ref)


def test_half_unmasked() -> None:
    """Right in float64 and float32; in bfloat16 (and float16) ignored tokens' softmax enters
    the gradients, as the ignored_not_zeroed slip does, the loss untouched."""
    b = LINEAR_CE_BUILTINS["ce-torch-half-unmasked"]
    assert b.form == "torch" and b.exposes["dtype"] == "bfloat16"
    batch = exposes_batch(b.exposes)
    for opts in (exposes_opts(b.exposes), ALL_ON | {"reduction": "sum"}):
        close(run(b.name, batch, opts), correct("torch", batch, opts))
        close(run(b.name, batch, opts, dtype=torch.float32),
              correct("torch", batch, opts, dtype=torch.float32), rtol=RTOL32, atol=ATOL32)
        # bfloat16 inputs: the result is that of the slip on the bf16-rounded batch, within
        # bf16's rounding (u = 2^-8) of the entries' scale
        rounded = replace(batch, h=torch.tensor(batch.h).bfloat16().double().numpy(),
                          E=torch.tensor(batch.E).bfloat16().double().numpy(),
                          b=torch.tensor(batch.b).bfloat16().double().numpy())
        for dtype in (torch.bfloat16, torch.float16):
            bad = run(b.name, batch, opts, dtype=dtype)
            good = correct("torch", batch, opts, dtype=dtype)
            slip = reference(rounded, opts, variant="ignored_not_zeroed")
            right = reference(rounded, opts)
            for k in ("dh", "dE", "db"):
                scale = float(np.abs(right[k]).max())
                got = np.asarray(bad[k], np.float64)
                np.testing.assert_allclose(got, slip[k], rtol=0.05, atol=0.03 * scale,
                                           err_msg=k)
                np.testing.assert_allclose(np.asarray(good[k], np.float64), right[k],
                                           rtol=0.05, atol=0.03 * scale, err_msg=k)
                far(got, right[k])
            np.testing.assert_allclose(np.asarray(bad["loss"], np.float64),
                                       np.asarray(good["loss"], np.float64), rtol=1e-2,
                                       atol=1e-2)


def test_ignore_index_hard_coded() -> None:
    """Right at ignore_index -100; at another it trains on the tokens ignored at that one as
    if it were a class: the contract's result with ignore_index -100."""
    b = LINEAR_CE_BUILTINS["ce-ignore-index-hard-coded"]
    ii = b.exposes["ignore_index"]
    assert ii == 5
    batch = exposes_batch({"ignored_fraction": _IGNORED_FRACTION})
    opts = ALL_ON | {"ce_weight": batch.w}
    close(run(b.name, batch, opts), correct("numpy", batch, opts))
    at5 = replace(batch, y=np.where(batch.y == -100, ii, batch.y), ignore_index=ii)
    as_class = replace(at5, ignore_index=-100)
    for opts in (exposes_opts(b.exposes), ALL_ON | {"reduction": "none"}):
        opts = {k: v for k, v in opts.items() if k != "ignore_index"}
        bad = run(b.name, at5, opts)
        close(bad, correct("numpy", as_class, opts))
        far(bad["dh"], correct("numpy", at5, opts)["dh"])


_IGNORED_FRACTION = 0.25
