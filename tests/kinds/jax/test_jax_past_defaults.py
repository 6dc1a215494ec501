"""The jax kind past its defaults: batches drawn well past 2 x 8 (up to the model's context),
the table run in the lower dtype the model runs it in, and the update an optimizer gives the
table judged, not only its state slots.

Each wrong target here is a small JAX model written the way the bug is shipped, and each is
first shown wrong against plain ``jax.grad`` (or plain optax) on the same model; a check at
2 x 8 tokens in float32 whose optimizer check counts slots passes all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_jax_kind  # noqa: F401  (sets this module's XLA flags before jax starts)

from tyingspec import standard_cases
from tyingspec._src.engine.observe import described, load, observe, own_case, shaped
from tyingspec._src.kinds.jax.target import JaxTarget
from tyingspec._src.kinds.table import kind_spec

V, D = 29, 8
HERE = "test_jax_past_defaults"


def _case(name: str) -> Any:
    return next(c for c in standard_cases(0) if c.name == name)


def _params() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"embed": jax.random.normal(k1, (V, D), jnp.float32),
            "w": jax.random.normal(k2, (D, D), jnp.float32) / D ** 0.5,
            "b": jnp.full((D,), 0.1, jnp.float32)}


def _ce(logits: Any, targets: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _body(x: Any, p: dict[str, Any]) -> Any:
    import jax.numpy as jnp

    return x + jnp.tanh(x @ p["w"] + p["b"])


def plain_loss(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
    E = p["embed"]
    return _ce(_body(E[tokens], p) @ E.T, targets)


# --- §1: a lookup that overwrites repeats only past the 16th token ---------------------------

def set_past_16() -> JaxTarget:
    """The zoo's ``.at[ids].set`` lookup, but adding the first 16 tokens: right at 2 x 8."""
    from tyingspec._src.kinds.jax.zoo import _set_lookup

    lookup = _set_lookup(added=16)

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        E = p["embed"]
        return _ce(_body(lookup(E, tokens), p) @ E.T, targets)

    return JaxTarget(loss_fn=loss_fn, params=_params)


@pytest.mark.slow
def test_the_lookup_that_overwrites_past_16_tokens_is_wrong_only_past_them() -> None:
    import jax

    loss = set_past_16().loss_fn
    assert loss is not None
    rng = np.random.default_rng(0)
    for T, wrong in ((8, False), (128, True)):
        t = rng.integers(0, V, (2, T))
        y = np.roll(t, -1, axis=-1)
        ours = jax.jit(jax.grad(loss))(_params(), t, y)["embed"]
        plain = jax.jit(jax.grad(plain_loss))(_params(), t, y)["embed"]
        assert bool(np.abs(np.asarray(ours) - np.asarray(plain)).max() > 1e-3) is wrong, T


def test_a_jax_case_runs_hundreds_of_tokens_and_finds_repeats_overwritten_past_16() -> None:
    target = load(f"{HERE}:set_past_16", "jax", isolate=False)
    case = own_case(target, _case("repeated-tokens"))
    assert case.N >= 256, case.describe()
    o = observe(target, case, checks=("gradient",))
    assert o.label == "duplicates_not_accumulated", o.diagnosis.headline()


def test_the_report_says_which_sizes_and_dtypes_the_cases_covered() -> None:
    target = load(f"{HERE}:set_past_16", "jax", isolate=False)
    cases, notes = shaped(target, kind_spec("jax").cases(0))
    text = "\n".join(notes)
    assert "no context declared" in text and "batches up to 2 x 512 = 1024 tokens" in text
    for c in cases:
        assert f"{c.name} " in text.split("sizes covered: ")[1]
        assert c.N >= 256, c.describe()
    # every case at a size of its own seed's drawing, the whole batch among them
    assert max(c.N for c in cases) == 1024 and len({c.N for c in cases}) > 1
    assert [c.setting.endswith("table=bfloat16") for c in cases] == [False, False, True, False]


def nnx_declared_context() -> Any:
    """An NNX model whose config declares max_len (lm1b's convention), sinusoids for the
    positions: no table to read it from."""
    from dataclasses import dataclass

    import jax.numpy as jnp
    from flax import nnx

    @dataclass(frozen=True)
    class Config:
        vocab: int = V
        width: int = D
        max_len: int = 96

    class LM(nnx.Module):
        def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
            self.config = config
            self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs)

        def __call__(self, tokens: Any) -> Any:
            T = tokens.shape[-1]
            pos = jnp.sin(jnp.arange(T)[:, None] / 10.0 ** (jnp.arange(D) / D))
            return self.embed.attend(self.embed(tokens) + pos)

    return LM(Config(), nnx.Rngs(0))


def nnx_position_table() -> Any:
    """nanoGPT's form: a position ``nnx.Embed`` read with ``arange(T)``."""
    import jax.numpy as jnp
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.wte = nnx.Embed(V, D, rngs=rngs)
            self.wpe = nnx.Embed(40, D, rngs=rngs)

        def __call__(self, tokens: Any) -> Any:
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1])[None])
            return self.wte.attend(jnp.tanh(x))

    return LM(nnx.Rngs(0))


def linen_sliced_positions() -> JaxTarget:
    """lm1b's learned ``pos_embedding`` [1, max_len, d], sliced to the sequence."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            embed = nn.Embed(V, D)
            pe = self.param("pos_embedding", nn.initializers.normal(0.02), (1, 72, D))
            return embed.attend(jnp.tanh(embed(tokens) + pe[:, :tokens.shape[-1]]))

    module = LM()
    return JaxTarget(module=module, params=module.init(jax.random.PRNGKey(0),
                                                       jnp.zeros((2, 8), jnp.int32)))


@pytest.mark.slow
@pytest.mark.moved
@pytest.mark.parametrize("attr,context,where", [
    ("nnx_declared_context", 96, "LM.config.max_len"),
    ("nnx_position_table", 40, "position table wpe/embedding [40, 8]"),
    ("linen_sliced_positions", 72, "position table params/pos_embedding [1, 72, 8]"),
])
def test_a_jax_check_runs_the_models_whole_declared_context(attr: str, context: int,
                                                            where: str) -> None:
    target = load(f"{HERE}:{attr}", "jax", isolate=False)
    seen = described(target)
    assert seen["tie"]["seq_len"] == context, seen
    assert f"context {context} positions ({where}" in seen["shape_note"]
    # short sequences: more of them, to a batch of a thousand tokens or more (16 at most)
    assert seen["tie"]["batch_size"] == min(16, -(-1024 // context))


def fixed_batch() -> JaxTarget:
    return JaxTarget(loss_fn=plain_loss, params=_params, batch_size=3, seq_len=5)


def test_a_target_that_fixes_its_batch_keeps_it() -> None:
    target = load(f"{HERE}:fixed_batch", "jax", isolate=False)
    cases, notes = shaped(target, kind_spec("jax").cases(0))
    assert {c.setting.split(",table")[0] for c in cases} == {"B=3,T=5"}, notes
    assert "3 x 5 tokens (the target's seq_len, batch_size)" in notes[0]


# --- §2: a head that halves the table's gradient only in bfloat16 ---------------------------

def head_halved_in_bfloat16() -> JaxTarget:
    """The zoo's halved head, halving only for a bfloat16 table: right in float32."""
    from tyingspec._src.kinds.jax.zoo import _halved_head

    head = _halved_head(only="bfloat16")

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        E = p["embed"]
        return _ce(head(_body(E[tokens], p), E), targets)

    return JaxTarget(loss_fn=loss_fn, params=_params)


@pytest.mark.slow
def test_the_bfloat16_head_is_wrong_only_for_a_bfloat16_table() -> None:
    import jax
    import jax.numpy as jnp

    loss = head_halved_in_bfloat16().loss_fn
    assert loss is not None
    t = np.arange(64).reshape(2, 32) % V
    y = np.roll(t, -1, axis=-1)
    for dtype, wrong in ((jnp.float32, False), (jnp.bfloat16, True)):
        p = {**_params(), "embed": _params()["embed"].astype(dtype)}
        ours = np.asarray(jax.jit(jax.grad(loss))(p, t, y)["embed"], np.float64)
        plain = np.asarray(jax.jit(jax.grad(plain_loss))(p, t, y)["embed"], np.float64)
        assert bool(np.abs(ours - plain).max() > 0.1 * np.abs(plain).max()) is wrong, dtype


@pytest.mark.slow
@pytest.mark.moved
def test_a_float32_table_also_runs_in_bfloat16_and_the_halved_head_shows() -> None:
    target = load(f"{HERE}:head_halved_in_bfloat16", "jax", isolate=False)
    own = observe(target, own_case(target, _case("token-zero")), checks=("gradient",))
    assert own.label == "correct" and own.precision == "float32", own.diagnosis.headline()
    low = own_case(target, _case("one-token-repeated"))
    assert "table=bfloat16" in low.setting
    o = observe(target, low, checks=("gradient", "forward"))
    assert o.precision == "bfloat16"
    assert o.diagnosis.wrong, o.diagnosis.headline()
    # the rows the halved output path alone makes wrong: tokens absent from the batch
    reads = set(low.tokens or ()) if low.tokens else set(np.asarray(o.batch.tokens).tolist())
    wrong = [f for f in o.diagnosis.findings if f.failed]
    assert wrong and wrong[0].check == "gradient against the forward", wrong
    rows = [int(r) for r in wrong[0].detail.split("rows [")[1].split("]")[0].split(", ")]
    assert rows and not set(rows) & reads, (rows, sorted(reads))


def nnx_float16_compute() -> Any:
    """An NNX model that declares its compute dtype: float16 (param_dtype float32)."""
    import jax.numpy as jnp
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(V, D, dtype=jnp.float16, param_dtype=jnp.float32,
                                   rngs=rngs)

        def __call__(self, tokens: Any) -> Any:
            return self.embed.attend(jnp.tanh(self.embed(tokens)))

    return LM(nnx.Rngs(0))


def test_the_low_dtype_is_the_one_the_model_declares() -> None:
    target = load(f"{HERE}:nnx_float16_compute", "jax", isolate=False)
    seen = described(target)
    assert (seen["tie"]["dtype"], seen["low_dtype"]) == ("float32", "float16")


@pytest.mark.slow
def test_a_declared_precision_runs_a_low_dtype_case_in_it() -> None:
    from tyingspec._src.kinds.jax.adapter import call_jax

    t = np.arange(32) % V
    inputs = {"tokens": t, "targets": np.roll(t, -1), "setting": "B=2,T=16,table=bfloat16",
              "checks": ()}
    own = call_jax("low", head_halved_in_bfloat16, inputs)
    assert (own.evidence["tie"]["dtype"], own.precision) == ("bfloat16", "bfloat16")
    declared = call_jax("low", head_halved_in_bfloat16, inputs | {"precision": "float64"})
    assert (declared.evidence["tie"]["dtype"], declared.precision) == ("float64", "float64")


def float32_only() -> JaxTarget:
    """A loss that refuses any table but a float32 one (a kernel with one dtype)."""
    import jax.numpy as jnp

    def loss_fn(p: dict[str, Any], tokens: Any, targets: Any) -> Any:
        if p["embed"].dtype != jnp.float32:
            raise TypeError(f"this kernel takes a float32 table, not {p['embed'].dtype}")
        return plain_loss(p, tokens, targets)

    return JaxTarget(loss_fn=loss_fn, params=_params)


@pytest.mark.slow
def test_a_model_that_refuses_a_bfloat16_table_runs_in_its_own_and_says_so() -> None:
    from tyingspec._src.kinds.jax.adapter import call_jax

    t = np.arange(32) % V
    out = call_jax("f32", float32_only, {"tokens": t, "targets": np.roll(t, -1),
                                         "setting": "B=2,T=16,table=bfloat16", "checks": ()})
    assert (out.evidence["tie"]["dtype"], out.precision) == ("float32", "float32")
    (note,) = [f for f in out.findings if f.check == "table in bfloat16"]
    assert note.outcome == "not_applicable" and "takes a float32 table" in note.detail


# --- §3: the update the table receives ------------------------------------------------------

def _with_optimizer(build: Any) -> JaxTarget:
    return JaxTarget(loss_fn=plain_loss, params=_params, table="embed", optimizer=build)


#: The table left out of the mask: optax.masked passes its gradient through as its update.
MASK = {"embed": False, "w": True, "b": True}


def masked_out() -> JaxTarget:
    import optax  # type: ignore[import-untyped]

    return _with_optimizer(lambda p: optax.masked(optax.adamw(1e-3), MASK))


def frozen() -> JaxTarget:
    import optax

    labels = {"embed": "frozen", "w": "train", "b": "train"}
    return _with_optimizer(lambda p: optax.multi_transform(
        {"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()}, labels))


def in_two_groups() -> JaxTarget:
    """Hand-written parameter groups whose updates are summed, the table in both (the optax
    form of a tensor listed in two torch parameter groups)."""
    import jax
    import optax

    groups = [{"embed": True, "w": True, "b": False}, {"embed": True, "w": False, "b": True}]

    def build(p: Any) -> Any:
        txs = [optax.masked(optax.adamw(1e-3), m) for m in groups]

        def init(params: Any) -> Any:
            return tuple(tx.init(params) for tx in txs)

        def update(g: Any, state: Any, params: Any = None) -> Any:
            total, states = None, []
            for tx, m, s in zip(txs, groups, state):
                u, s = tx.update(g, s, params)
                mine = {k: u[k] if m[k] else 0 * u[k] for k in u}  # the group's own leaves
                total = mine if total is None else jax.tree_util.tree_map(
                    lambda a, b: a + b, total, mine)
                states.append(s)
            return total, tuple(states)

        return optax.GradientTransformation(init, update)

    return _with_optimizer(build)


def decay_masked() -> JaxTarget:
    """Correct: AdamW that leaves the table out of weight decay only (a common choice)."""
    import optax

    return _with_optimizer(lambda p: optax.adamw(1e-3, weight_decay=0.1, mask=MASK))


def _target_optimizer(attr: str) -> Any:
    import jax
    import jax.numpy as jnp

    from tyingspec._src.core.process_state import jax_state_kept
    from tyingspec._src.kinds.jax.discover import build_form, discover
    from tyingspec._src.kinds.jax.identity import optimizer_findings

    with jax_state_kept():
        jax.config.update("jax_enable_x64", True)  # as in the worker
        form = build_form(attr, globals()[attr]())
        t = jnp.asarray(np.arange(48).reshape(2, 24) % V)
        y = jnp.roll(t, -1, axis=-1)
        tie, _, tr = discover(attr, form, t, y)
        findings = optimizer_findings(attr, form, tie, t, y, tr)
    return next(f for f in findings if f.check == "optimizer from the target")


@pytest.mark.slow
def test_the_masked_table_really_ascends() -> None:
    import jax
    import optax

    p = _params()
    t = np.arange(48).reshape(2, 24) % V
    g = jax.jit(jax.grad(plain_loss))(p, t, np.roll(t, -1, axis=-1))
    tx = optax.masked(optax.adamw(1e-3), MASK)
    u, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(g, p)
    assert float((np.asarray(u["embed"]) * np.asarray(g["embed"])).sum()) > 0


def test_a_table_masked_out_of_the_optimizer_is_named_an_ascent_step() -> None:
    f = _target_optimizer("masked_out")
    assert f.failed, f.line()
    assert "wrong sign" in f.detail and "optax.masked" in f.detail, f.detail


@pytest.mark.slow
@pytest.mark.parametrize("attr,failed,says", [
    ("frozen", True, "not stepped"),
    ("in_two_groups", True, "stepped twice"),
    ("decay_masked", False, "by one update"),
])
def test_the_update_the_table_receives_is_judged(attr: str, failed: bool, says: str) -> None:
    f = _target_optimizer(attr)
    assert f.failed is failed, f.line()
    assert says in f.detail, f.detail
    if attr == "in_two_groups":
        assert f.label == "optimizer_sees_tie_twice"


# --- the whole check -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("attr,code,failing", [
    ("set_past_16", 1, "gradient"),
    ("head_halved_in_bfloat16", 1, "gradient"),
    ("masked_out", 1, "optimizer from the target"),
    ("decay_masked", 0, None),
])
def test_tyingspec_check_judges_each_target_past_the_defaults(attr: str, code: int,
                                                              failing: str | None) -> None:
    from tyingspec._src.front.check import check_target

    report = check_target(f"{HERE}:{attr}", "jax", 0)
    heads = [r.diagnosis.headline() for r in report.results if r.diagnosis is not None]
    assert report.load_error is None and report.exit_code == code, heads
    assert any(n.startswith("sizes covered: ") for n in report.notes), report.notes
    if failing == "gradient":
        # the overwritten repeats in every case of the table's own dtype (in 16 bits a row
        # read hundreds of times rounds by more than they lose), the halved head in bfloat16
        assert all(r.diagnosis and r.diagnosis.wrong for r in report.results
                   if (attr == "set_past_16") != ("table=bfloat16" in r.case.setting)), heads
    elif failing is not None:
        assert all(any(f.failed and f.check == failing for f in r.diagnosis.findings)
                   for r in report.results if r.diagnosis is not None), heads
