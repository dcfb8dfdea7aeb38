"""The semaphore and the read-write lock under faults: time passing, frozen holders, lost leases."""

from __future__ import annotations

import logging

import pytest

import distlocks
from distlocks.semaphore import _agreed
from tests.conftest import DB

pytestmark = DB

# The lease backends across processes, on which a semaphore's permits count is a lease its users share.
MARKER_ALIASES = ["default", "mariadb", "postgresql", "redis", "redlock"]


@pytest.mark.parametrize("alias", MARKER_ALIASES, indirect=True)
def test_every_user_of_the_same_count_renews_the_permits_record_and_warns_of_nothing(
    alias, leave_nothing, name, workers, caplog
):
    sem = distlocks.semaphore(name, 2, using=alias, ttl=5, wait=0)
    with sem:
        pass
    first = sem.marker.holder()
    # Another process (its first use of the semaphore) renews the record it did not take.
    assert workers("take_permit", alias, name, 2, 0).finish()[0] == "acquired"
    assert sem.marker.holder().expires_at > first.expires_at
    # This process, looking again a ttl later, neither.
    _agreed.clear()
    with caplog.at_level(logging.WARNING, logger="distlocks.semaphore"), sem:
        pass
    assert "SECRET_KEY" not in caplog.text
    with pytest.raises(ValueError, match="permits is 3, but"):
        distlocks.semaphore(name, 3, using=alias, wait=0).acquire()
