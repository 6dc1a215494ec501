"""What the property checks share on top of the engine: a seeded generator and row lists.

Not a property module: nothing here registers.  Calling an adapter, the reference, the precision
and every tolerance come from :mod:`engine.observe`; a property only decides *what* to call
and which invariant to hold it to.
"""

from __future__ import annotations

import numpy as np

from tyingspec._src.core.cases import Case
from tyingspec._src.core.render import rows_text
from tyingspec._src.engine.observe import Target

__all__ = ["Target", "rows_text", "seeded"]


def seeded(case: Case, salt: int) -> np.random.Generator:
    """A generator for a property's own random choices, reproducible from the case's seed."""
    return np.random.default_rng([case.seed, salt])
