"""SQLite's wake-ups (``distlocks.backends.db.wake``): killed, stopped and forked waiters."""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.db import connections

from distlocks.backends.db.queue import WAITER_LEASE
from distlocks.backends.db.wake import UNHEARD_BEFORE_POLLING, _address, alarm, database_id
from distlocks.handler import locks
from distlocks.models import LockWaiter
from tests.conftest import DB, Holder, Worker
from tests.faults.test_core import until

pytestmark = [DB, pytest.mark.parametrize("alias", ["default"], indirect=True)]

# How long the next in line may take beyond the place lease of a waiter that stopped answering: a fallback look.
_SLACK = 1.0


def bound(address):
    """True if an abstract Unix socket is bound to ``address`` on this host."""
    with open("/proc/net/unix") as table:
        return any(line.rstrip().endswith("@" + address[1:].decode()) for line in table)


def sleeping_waiters(alias, name, workers):
    """A holder of ``name``, and two worker processes queued behind it, each sleeping on its socket:
    (holder, [(worker, its socket's address)] in the queue's order)."""
    key = locks[alias].make_key(name)
    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=key)
    database = database_id(connections[locks[alias].database])
    holder = Holder(name, alias, ttl=60)
    waiters = []
    for count in (1, 2):
        worker = workers("take", alias, name, 60)
        until(lambda count=count: queue.count() == count, 30)
        address = _address(database, key, queue.order_by("-id").values_list("id", flat=True)[0])
        until(lambda address=address: bound(address), 30)
        waiters.append((worker, address))
    return holder, waiters


def test_the_next_in_line_is_served_once_the_place_of_a_killed_sleeping_waiter_ran_out(alias, name, workers):
    holder, [(first, address), (second, _)] = sleeping_waiters(alias, name, workers)
    first.kill()  # SIGKILL while it sleeps on its socket: the release's datagram goes nowhere
    assert not bound(address)  # the kernel freed its name: nothing is left that a later waiter would meet
    assert holder.release() is None
    started = time.monotonic()
    assert second.line()[0] == "acquired"
    waited = time.monotonic() - started
    assert waited < WAITER_LEASE + _SLACK, f"served {waited:.2f} s after the release ({WAITER_LEASE} s places)"
    second.finish()


def test_a_stopped_first_waiter_woken_by_the_release_holds_up_the_others_only_while_its_place_lasts(
    alias, name, workers
):
    holder, [(first, _), (second, _)] = sleeping_waiters(alias, name, workers)
    os.kill(first.process.pid, signal.SIGSTOP)
    try:
        assert holder.release() is None  # wakes the first, which reads nothing now
        started = time.monotonic()
        assert second.line()[0] == "acquired"
        waited = time.monotonic() - started
        assert waited < WAITER_LEASE + _SLACK, f"served {waited:.2f} s after the release ({WAITER_LEASE} s places)"
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    assert first.line()[0] == "acquired"  # resumed, it queues again and is served
    second.finish()
    first.finish()


def test_a_forked_child_keeps_no_waiter_socket_bound(alias, name):
    database = database_id(connections[locks[alias].database])
    sleeper = alarm(database, locks[alias].make_key(name), 1)
    assert sleeper is not None
    address = _address(database, locks[alias].make_key(name), 1)
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(ready_write, b"1")
        os.read(done_read, 1)
        os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"1"
        sleeper.close()
        # The child still runs; had it kept its copy, the name would stay bound and the next place's waiter would poll.
        assert not bound(address)
        again = alarm(database, locks[alias].make_key(name), 1)
        assert again is not None
        again.close()
    finally:
        os.write(done_write, b"1")
        os.waitpid(child, 0)
        for fd in (ready_read, ready_write, done_read, done_write):
            os.close(fd)


def rounds_until_polling(alias, name, tmp_path, prefix, rounds):
    """A worker (started under ``prefix``) waits for ``name`` behind a holder in this process, round after
    round: what it said at each acquisition ("sleeps" or "polls"), up to its first "polls"."""
    queue = LockWaiter.objects.using(locks[alias].database).filter(lock_name=locks[alias].make_key(name))
    holder = Holder(name, alias, ttl=60)
    worker = Worker("take_rounds", alias, name, tmp_path / "go", prefix=prefix)
    said = []
    try:
        for round_ in range(rounds):
            until(lambda: queue.count() == 1, 30)  # queued, about to sleep on its socket
            assert holder.release() is None
            word, how = worker.line()
            assert word == "acquired"
            said.append(how)
            if how == "polls":
                break
            holder = Holder(name, alias, ttl=60)  # once the worker has released
            (tmp_path / f"go.{round_}").touch()
    finally:
        worker.kill()
        if holder.thread.is_alive():
            holder.release()
    return said


def test_a_waiter_whose_releases_go_unheard_polls_instead(alias, name, tmp_path):
    # In a network namespace of its own (another container sharing the file), abstract
    # names are not this process's: its wake-ups never arrive, and only its fallback looks find the lock.
    said = rounds_until_polling(alias, name, tmp_path, ("unshare", "--net"), rounds=30)
    assert said[-1] == "polls", said
    assert len(said) >= UNHEARD_BEFORE_POLLING, said


def test_a_waiter_that_hears_the_releases_keeps_sleeping(alias, name, tmp_path):
    said = rounds_until_polling(alias, name, tmp_path, (), rounds=8)
    assert said == ["sleeps"] * 8


def test_a_wake_up_that_came_during_the_look_is_heard_and_polling_ends_after_a_while(alias, name, monkeypatch):
    from distlocks.backends.db import wake as wakes

    database = database_id(connections[locks[alias].database])
    key = locks[alias].make_key(name)
    sleeper = alarm(database, key, 1)
    assert sleeper is not None
    try:
        for _ in range(UNHEARD_BEFORE_POLLING):
            wakes.wake(database, key, 1)  # sent after the sleep ran out, before the look ended
            sleeper.unheard()
            assert sleeper.wait(1) is True
        assert wakes.hears(database)
        monkeypatch.setattr(wakes, "POLL_FOR", 0.2)
        for _ in range(UNHEARD_BEFORE_POLLING):
            sleeper.unheard()
        assert not wakes.hears(database)
        assert alarm(database, key, 2) is None  # its waiters poll...
        until(lambda: wakes.hears(database), 5)  # ...for a while, then sleep on wake-ups again
        again = alarm(database, key, 2)
        assert again is not None
        again.close()
    finally:
        sleeper.close()
