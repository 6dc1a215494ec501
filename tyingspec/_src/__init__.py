"""tyingspec's internals (everything but the public surface in ``tyingspec/__init__.py``).

Floors, bottom up, each importing only the ones below it: ``core`` (what every kind shares),
``kinds`` (one folder per adapter kind, and the table naming them), ``engine`` (observing one
target on one case, in its own process), then the front ends (``front``, ``ckpt``,
``reproduce``).  ``tests/test_layout.py`` pins it.
"""
