"""Redlock over five independent Redis servers, with nodes stopped and restarted."""

from __future__ import annotations

import threading
import time

import pytest
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.checks import check_distlocks

from .conftest import DB

pytestmark = [DB, pytest.mark.servers("redis")]


@pytest.fixture
def nodes(redis_servers):
    """The five Redlock servers; every one is running again after the test."""
    yield redis_servers
    for server in redis_servers:
        if server.process is None:
            server.start()


def other_thread_acquires(name, wait=0):
    result = []
    thread = threading.Thread(target=lambda: result.append(distlocks.lock(name, using="redlock").acquire(wait=wait)))
    thread.start()
    thread.join(30)
    return result[0]


def test_works_with_a_minority_of_nodes_down(nodes, name):
    for server in nodes[:2]:
        server.stop()
    with distlocks.lock(name, using="redlock") as lk:
        assert lk.token > 0
        assert other_thread_acquires(name) is False
    assert other_thread_acquires(name) is True


def test_refuses_when_a_majority_is_down(nodes, name):
    for server in nodes[:3]:
        server.stop()
    started = time.monotonic()
    with pytest.raises(distlocks.BackendUnavailable, match="only 2 of 5 Redis nodes answer, 3 are needed"):
        distlocks.lock(name, using="redlock").acquire(wait=1)
    assert time.monotonic() - started < 10


def test_nodes_restarted_empty_never_make_two_holders(nodes, name):
    holder = distlocks.lock(name, using="redlock", ttl=30)
    holder.acquire()
    # Two of the five forget everything: the lock stays on the other three.
    for server in nodes[:2]:
        server.restart()
    assert other_thread_acquires(name, wait=0.5) is False
    holder.release()
    assert other_thread_acquires(name) is True


def test_the_holder_loses_it_when_a_majority_forgets(nodes, name):
    holder = distlocks.lock(name, using="redlock", ttl=0.9)
    holder.acquire()
    for server in nodes[:3]:
        server.restart()
    deadline = time.monotonic() + 5
    while not holder.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.lost
    with pytest.raises(distlocks.LockLost):
        holder.release()


def test_a_failed_attempt_leaves_nothing_behind(nodes, name):
    # Held on three nodes by someone else: an attempt wins at most two, and
    # must give those back.
    holder = distlocks.lock(name, using="redlock")
    holder.acquire()
    assert other_thread_acquires(name, wait=0.2) is False
    holder.release()
    assert other_thread_acquires(name) is True


@pytest.mark.parametrize("ttl", [1, 0.5])
@pytest.mark.parametrize("kind", ["lock", "permit", "multi", "async"])
def test_a_new_process_takes_a_short_lease_at_its_first_acquire(nodes, name, workers, kind, ttl):
    # Its first acquire imports redis-py (a quarter of a second here) and connects to the five nodes:
    # none of that may count against the lease's tenth that a node has to answer in.
    assert workers("first_take", kind, "redlock", name, ttl, fresh=True).finish() == ["fresh", "acquired"]


@pytest.mark.parametrize("caches", [None, [], "r1", ["r1", "r1"], [1, 2]])
def test_bad_caches_option(settings, caches):
    options = {} if caches is None else {"CACHES": caches}
    settings.DISTLOCKS = {"rl": {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "OPTIONS": options}}
    with pytest.raises(ImproperlyConfigured, match=r"DISTLOCKS\['rl'\]\['OPTIONS'\]\['CACHES'\]"):
        distlocks.lock("x", using="rl")
    assert [m.id for m in check_distlocks()] == ["distlocks.E002"]


def test_too_few_nodes_is_a_warning(settings):
    settings.DISTLOCKS = {"rl": {"BACKEND": "distlocks.backends.redlock.RedlockBackend", "OPTIONS": {"CACHES": ["r1"]}}}
    assert [m.id for m in check_distlocks()] == ["distlocks.W003"]
