"""Hypothesis profiles for tyingspec's own suite: `dev` locally, the derandomized `ci` under CI."""

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("ci"), max_examples=30,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models: intra-op threads only add overhead, and on
    a loaded machine (or under pytest -n) that overhead made one check take seconds instead of
    tens of milliseconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
