"""The LocMem backend: what is its own (stores, waking waiters, forks); tests/test_lock.py runs the lock contract on it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command

import distlocks
from distlocks.backends import locmem
from distlocks.backends.locmem import LocMemBackend
from distlocks.handler import locks
from distlocks.testing import override_distlocks
from tests.conftest import Holder
from tests.test_lock import in_thread

LOCMEM = "distlocks.backends.locmem.LocMemBackend"


class CountingLocMem(LocMemBackend):
    """A LocMem backend that counts the attempts to take a lock (class-wide: every thread has its own instance)."""

    attempts = 0

    def try_acquire(self, key, owner, ttl):
        type(self).attempts += 1
        return super().try_acquire(key, owner, ttl)


@pytest.fixture
def counting():
    CountingLocMem.attempts = 0
    with override_distlocks({"default": {"BACKEND": "tests.test_locmem.CountingLocMem", "LOCATION": "counting"}}):
        yield
    locmem.forget("counting")


def wait_in_thread(name, wait, alias="default"):
    """Start a thread that waits for ``name``; return it and a dict with how long it waited."""
    result = {}

    def run():
        started = time.monotonic()
        with distlocks.lock(name, using=alias, wait=wait):
            result["waited"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_waiter_is_woken_by_the_release_not_by_polling(counting, name):
    holder = Holder(name)
    thread, result = wait_in_thread(name, 30)
    time.sleep(0.5)  # the waiter sleeps all along
    assert CountingLocMem.attempts == 2  # the holder's, and the waiter's one try before it slept
    released = time.monotonic()
    assert holder.release() is None
    thread.join(30)
    assert time.monotonic() - released < 0.5
    assert result["waited"] >= 0.5
    assert CountingLocMem.attempts == 3


def test_a_waiter_is_woken_when_the_lease_runs_out(counting, name):
    lk = distlocks.lock(name, ttl=0.5, renew=False)
    lk.acquire()
    thread, result = wait_in_thread(name, 30)
    thread.join(30)
    assert 0.3 <= result["waited"] < 1.5
    assert CountingLocMem.attempts == 3
    with pytest.raises(distlocks.LockLost):
        lk.release()


def test_a_bounded_wait_ends_on_time_while_the_lock_is_held(counting, name):
    holder = Holder(name)
    started = time.monotonic()
    assert in_thread(lambda: distlocks.lock(name).acquire(wait=0.3)) is False
    assert 0.3 <= time.monotonic() - started < 1
    assert CountingLocMem.attempts == 3  # the holder's, one try before sleeping, one at the deadline: no polling
    assert holder.release() is None


def test_aliases_have_stores_of_their_own_unless_they_name_the_same_location(name):
    setting = {
        "a": {"BACKEND": LOCMEM},
        "b": {"BACKEND": LOCMEM},
        "c": {"BACKEND": LOCMEM, "LOCATION": "a"},
    }
    with override_distlocks(setting):
        with distlocks.lock(name, using="a"):
            assert in_thread(lambda: distlocks.lock(name, using="b").acquire(wait=0)) is True
            assert in_thread(lambda: distlocks.lock(name, using="c").acquire(wait=0)) is False
        assert in_thread(lambda: distlocks.lock(name, using="c").acquire(wait=0)) is True


def test_held_holder_list_release_and_cleanup(name):
    holder = Holder(name, "locmem", thread_name=f"holder-{name}", ttl=30)
    info = locks["locmem"].holder(name)
    assert (info.alias, info.key, info.hold_count, info.token) == ("locmem", name, 1, holder.token)
    assert info.owner.endswith(f":{os.getpid()}:holder-{name}/{holder.thread.ident}")
    assert 29 < info.lease_left() <= 30
    waiter, _ = wait_in_thread(name, 30, "locmem")
    deadline = time.monotonic() + 5
    while locks["locmem"].holder(name).waiters != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)

    out = StringIO()
    call_command("distlocks_list", "--using", "locmem", "--json", stdout=out)
    row = next(row for row in json.loads(out.getvalue()) if row["key"] == name)
    assert (row["token"], row["hold_count"], row["waiters"]) == (holder.token, 1, 1)

    out = StringIO()
    call_command("distlocks_release", name, "--using", "locmem", "--token", str(holder.token), "--yes", stdout=out)
    assert out.getvalue() == f"locmem: released {name!r}\n"
    waiter.join(30)  # woken by the force-release
    assert isinstance(holder.release(), distlocks.LockLost)

    expired = distlocks.lock(f"{name}-old", using="locmem", ttl=0.1, renew=False)
    expired.acquire()
    time.sleep(0.2)
    assert locks["locmem"].holder(expired.key) is None
    assert locks["locmem"].clear_expired(dry_run=True) >= 1
    out = StringIO()
    call_command("distlocks_cleanup", "--using", "locmem", stdout=out)
    assert out.getvalue().startswith("locmem: deleted ")
    assert locks["locmem"].clear_expired(dry_run=True) == 0
    with pytest.raises(distlocks.LockLost):
        expired.release()


def test_force_release_without_a_token_frees_whoever_holds_it(name):
    holder = Holder(name, "locmem")
    assert locks["locmem"].force_release(name) is True
    assert locks["locmem"].force_release(name) is False
    assert isinstance(holder.release(), distlocks.LockLost)


def run_in_child(child):
    """Fork; run ``child()`` in the child, whose truth is its exit status; return that status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_holds_none_of_its_parents_locks(name):
    lk = distlocks.lock(name, using="locmem", ttl=30)
    lk.acquire()
    parent_token = lk.token

    def child():
        mine = distlocks.lock(name, using="locmem", wait=0)
        taken = mine.acquire() and mine.token > parent_token and mine.hold_count == 1
        mine.release()
        return taken and lk.hold_count == 0 and distlocks.lock(f"{name}-child", using="locmem").acquire(wait=0)

    assert run_in_child(child) == 0
    assert lk.hold_count == 1
    assert locks["locmem"].holder(lk.key).token == parent_token  # the child's locks are its own
    assert locks["locmem"].holder(f"{name}-child") is None
    lk.release()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_another_thread_is_inside_the_store_can_lock(name):
    store = locmem.store("locmem")
    inside, leave = threading.Event(), threading.Event()

    def stay_inside():
        with store.locked:
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=stay_inside)
    thread.start()
    assert inside.wait(30)
    try:
        # Without a new mutex in the child, its acquire would wait forever for the parent's thread.
        assert run_in_child(lambda: distlocks.lock(name, using="locmem").acquire(wait=1)) == 0
    finally:
        leave.set()
        thread.join(30)
