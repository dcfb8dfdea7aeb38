"""The pytest plugin of distlocks (entry point ``distlocks``): fixtures for testing code that takes locks.

It reads no Django setting until a fixture is used, so that it stays out of
the way of projects that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def distlocks_backend() -> Iterator[str]:
    """Every ``DISTLOCKS`` alias in memory (LocMem), empty, for this test; the value is the ``"default"`` alias."""
    from distlocks.testing import override_distlocks

    with override_distlocks():
        yield "default"


@pytest.fixture
def expire_lock() -> Callable[..., None]:
    """``expire_lock(lock)``: end a held LocMem lock's lease now; return once its holder was told (``lock_lost``)."""
    from distlocks.testing import expire_lock as expire

    return expire
