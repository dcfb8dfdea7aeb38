"""The semaphore and the read-write lock under faults: time passing, frozen holders, lost leases."""

from __future__ import annotations

import logging

import pytest

import distlocks
from distlocks.backends.redlock import RedlockBackend
from distlocks.handler import locks
from distlocks.semaphore import _agreed
from tests.conftest import DB
from tests.faults.conftest import behind_proxy
from tests.test_lock import in_thread

pytestmark = DB

# The lease backends across processes, on which a semaphore's permits count is a lease its users share.
MARKER_ALIASES = ["default", "mariadb", "postgresql", "redis", "redlock"]


def lease_end(lk):
    """When the lease of ``lk`` ends on its server; on Redlock, the end a majority of the nodes shows at least.

    (Redlock's ``holder()`` shows the earliest end of any node, and a renewal that reached a majority in
    time may reach a slow node late or not at all.)
    """
    backend = locks[lk.alias]
    if not isinstance(backend, RedlockBackend):
        return lk.holder().expires_at
    shown = [node.holder(lk.key) for node in backend.nodes]
    ends = sorted((info.expires_at for info in shown if info is not None), reverse=True)
    return ends[backend.quorum - 1]


@pytest.mark.parametrize("alias", MARKER_ALIASES, indirect=True)
def test_every_user_of_the_same_count_renews_the_permits_record_and_warns_of_nothing(
    alias, leave_nothing, name, workers, caplog
):
    sem = distlocks.semaphore(name, 2, using=alias, ttl=5, wait=0)
    with sem:
        pass
    first = lease_end(sem.marker)
    # Another process (its first use of the semaphore) renews the record it did not take.
    assert workers("take_permit", alias, name, 2, 0).finish()[0] == "acquired"
    assert lease_end(sem.marker) > first
    # This process, looking again a ttl later, neither.
    _agreed.clear()
    with caplog.at_level(logging.WARNING, logger="distlocks.semaphore"), sem:
        pass
    assert "SECRET_KEY" not in caplog.text
    with pytest.raises(ValueError, match="permits is 3, but"):
        distlocks.semaphore(name, 3, using=alias, wait=0).acquire()


@pytest.mark.parametrize("alias", ["mariadb", "postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_side_whose_release_never_reached_the_server_can_be_taken_again_at_once(alias, leave_nothing, name, mode):
    with behind_proxy(alias) as proxy:
        rw = distlocks.read_write_lock(name, using="proxied", ttl=30)
        side = rw.read() if mode == "read" else rw.write()
        assert side.acquire(wait=0)
        token = side.token
        proxy.stall()  # the release goes nowhere: the server keeps the hold, live for 30 s
        with pytest.raises(distlocks.BackendUnavailable):
            side.release()
        # The same thread asks again, on a new connection: its own leftover neither breaks nor blocks it.
        assert side.acquire(wait=0)
        assert side.token > token
        side.release()
        assert in_thread(lambda: distlocks.read_write_lock(name, using="proxied").write().acquire(wait=0))
