"""tyingspec's property suite: one named property per invariant (installed as
``tyingspec.properties``).

Use them directly::

    from hypothesis import given
    from tyingspec.properties import PROPERTIES
    prop = PROPERTIES["sum_of_paths"]
    given(prop.strategy())(lambda case: prop.check(my_fn, "mymod:my_fn", "model", case))()
"""

from . import _gradients  # noqa: F401  (registers the properties)
from ._core import PROPERTIES, Property, PropertyFailure, for_kind, register, require_power

__all__ = ["PROPERTIES", "Property", "PropertyFailure", "for_kind", "register", "require_power"]
