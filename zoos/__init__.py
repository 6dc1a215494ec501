"""Zoos of real models built from tiny configs, shared by the tests and the benchmarks.

They live outside ``tests/`` so that ``benchmarks/`` imports them as ``zoos.<name>`` without
reaching into the test suite, and ``tyingspec check zoos.transformers_zoo:<factory>`` runs from
the repository's root as a user's target would."""
