"""The jax kind's properties: a user's own JAX or Flax model, one invariant each.

Each draws a batch composition (its shape is the model's own: vocabulary, width, batch x
sequence) and observes the model once through the engine; the call runs only the property's
own checks.  Optimizer and identity checks do not depend on the batch and run once per worker.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tyingspec._src.core.cases import Case
from tyingspec._src.core.strategies import cases
from tyingspec._src.engine.observe import Target

from ._core import PropertyFailure, register, require_power, require_rows

# The torch kind's two helpers are the kind-agnostic ones: a call running only the
# property's checks, and a property failing on its own findings (by check-name prefix).
from ._torch import _fail_on, _observed

#: Compositions a model's fixed shape can always hold (N may exceed V: no "distinct" there).
JAX_COMPOSITIONS = ("random", "repeats", "one-token", "with-zero", "no-zero", "sparse")


def jax_cases() -> st.SearchStrategy[Case]:
    """A composition and a seed; V, d and N are the model's (set when the case is run)."""
    return cases(max_vocab=48, min_vocab=8, dtypes=("float64",),
                 compositions=JAX_COMPOSITIONS, degenerate=False)


@register("jax_tie_identity", "ID", jax_cases)
def jax_tie_identity(target: Target, case: Case) -> None:
    """The lookup and the head read one leaf of the parameter tree, at construction, through a
    jitted training step (whose loss is the model's at the parameters it is handed: no stale
    closed-over table) and after flax.serialization and orbax round trips."""
    _fail_on("jax_tie_identity", _observed(target, case, "identity"),
             ("tie discovered", "identity"))


@register("jax_optimizer_sees_tie_once", "ID", jax_cases)
def jax_optimizer_sees_tie_once(target: Target, case: Case) -> None:
    """optax.adamw and the target's own optimizer see the table as one leaf with one state
    slot per moment, and one step moves it by exactly one update."""
    _fail_on("jax_optimizer_sees_tie_once", _observed(target, case, "optimizer"),
             ("tie discovered", "optimizer"))


@register("jax_gradient_by_path", "SUM", jax_cases)
def jax_gradient_by_path(target: Target, case: Case) -> None:
    """jax.grad of the target's loss (its own custom_vjp backwards included) equals, row by
    row, the scatter-add of dx plus g.T @ h, recorded at the table's uses in the loss's jaxpr
    with every custom_vjp's primal differentiated by JAX instead of its backward."""
    o = _observed(target, case, "gradient")
    _fail_on("jax_gradient_by_path", o, ("tie discovered",))
    if (o.diagnosis.rows_label or o.diagnosis.label) != "no_power":
        require_rows("jax_gradient_by_path", o)
        return
    o = _observed(target, case, "gradient", "forward")
    if o.diagnosis.wrong:
        raise PropertyFailure("jax_gradient_by_path",
                              "the tied gradient is not the sum of its two paths", o.case,
                              diagnosis=o.diagnosis)
    require_power(o.diagnosis)


@register("jax_gradient_against_forward", "SUM", jax_cases)
def jax_gradient_against_forward(target: Target, case: Case) -> None:
    """jax.grad of the whole loss agrees with directional central differences of the forward
    (float64 where the model computes in it): a custom_vjp wrong at both uses cannot vouch
    for itself.  Rows are localised by group testing."""
    _fail_on("jax_gradient_against_forward", _observed(target, case, "forward"),
             ("gradient against the forward",))
