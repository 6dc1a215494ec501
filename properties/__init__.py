"""tyingspec's property suite: one named property per invariant (installed as
``tyingspec.properties``).

Use them directly::

    from hypothesis import given
    from tyingspec.properties import PROPERTIES
    prop = PROPERTIES["sum_of_paths"]
    from tyingspec import load
    target = load("mymod:my_fn", "model")
    given(prop.strategy())(lambda case: prop.check(target, case))()

Every property's docstring (``PROPERTIES[name].doc``) states its invariant.  ``cases`` is the
strategy they draw from (see :mod:`core.strategies`); ``SIGNATURES`` are the mutant zoo's
fingerprints, for tyingspec's own power tests (not user-facing properties).
"""

# Importing a module registers its properties; this order is the order they are listed and
# run in (the gradient first, then its rows, then metamorphic and hygiene properties).
# isort: off
from . import _gradients  # noqa: F401
from . import _rows  # noqa: F401
from . import _relabel  # noqa: F401
from . import _accumulation  # noqa: F401
from . import _outputs  # noqa: F401
from . import _hygiene  # noqa: F401
from . import _tie  # noqa: F401
from . import _kernel  # noqa: F401
from . import _torch  # noqa: F401  (imports no torch: the call does, in the worker)
from . import _linear_ce  # noqa: F401
from . import _jax  # noqa: F401  (imports no jax: the call does, in the worker)
from . import _distributed  # noqa: F401  (imports no torch: the call does, where ranks run)
# isort: on
from tyingspec._src.core.strategies import cases, compositions

from ._core import (
    PROPERTIES,
    Property,
    PropertyFailure,
    discard,
    for_kind,
    label_locked,
    register,
    require_power,
)

__all__ = ["PROPERTIES", "Property", "PropertyFailure", "cases", "compositions", "discard",
           "for_kind", "label_locked", "register", "require_power"]
