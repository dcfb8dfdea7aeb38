"""The multi-lock on every backend: all or none, one deadline, never a deadlock between processes."""

from __future__ import annotations

import time

import pytest

import distlocks
from distlocks.inspection import force_release, holder

from .conftest import DB, PROCESS_ALIASES, guarded_events

pytestmark = DB


@pytest.fixture
def names(name):
    return [f"{name}-a", f"{name}-b", f"{name}-c"]


def held(alias, lock_name):
    return holder(alias, distlocks.lock(lock_name, using=alias).key) is not None


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_overlapping_sets_in_opposite_orders_never_deadlock_nor_overlap(alias, leave_nothing, names, workers, tmp_path):
    log = tmp_path / "events"
    a, b, c = names
    # The two sets share b and c, named in opposite orders: without one order,
    # each would take its first and wait for the other's.
    running = [workers("multi", alias, f"{a},{b},{c}", 3, log), workers("multi", alias, f"{c},{b}", 3, log)]
    results = [worker.finish() for worker in running]
    for done, taken, timeouts in results:
        assert done == "done"
        assert int(taken) > 0
        assert int(timeouts) == 0
    events = guarded_events(log)
    assert {event[1] for event in events} == {str(worker.process.pid) for worker in running}
    assert not any(held(alias, lock_name) for lock_name in names)


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_all_or_none_within_one_deadline(alias, leave_nothing, names, workers):
    a, b, c = names
    for busy in (b, c):
        assert workers("hold", alias, busy, 30).line()[0] == "acquired"
    lk = distlocks.multi_lock([c, a, b], using=alias, wait=1)
    started = time.monotonic()
    assert not lk.acquire()
    # One deadline for the set: not a second per busy member.
    assert 1 <= time.monotonic() - started < 1.8
    assert lk.hold_count == 0
    assert not held(alias, a)  # taken, then given back
    assert workers("take", alias, a, 0).finish()[0] == "acquired"
    with pytest.raises(distlocks.LockNotAcquired), distlocks.multi_lock([a, b], using=alias, wait=0):
        pass
    assert not held(alias, a)


def test_the_lock_api(alias, leave_nothing, names):
    a, b, c = names
    lk = distlocks.multi_lock([c, a, b, a], using=alias, wait=1)
    assert lk.names == (a, b, c)  # sorted, duplicates merged
    with pytest.raises(distlocks.LockNotOwned):
        lk.token  # noqa: B018
    with lk as same:
        assert same is lk
        assert lk.tokens == {member.name: member.token for member in lk.locks}
        assert lk.token == tuple(lk.tokens[n] for n in (a, b, c))
        with distlocks.lock(b, using=alias, wait=0) as single:  # the members are the ordinary locks
            assert single.token == lk.tokens[b]
        with lk:  # reentrant per thread
            assert lk.hold_count == 2
        assert all(held(alias, n) for n in names)
    assert not any(held(alias, n) for n in names)
    with pytest.raises(distlocks.LockNotOwned):
        lk.release()

    @distlocks.multi_lock([a, b], using=alias, wait=0)
    def inside():
        return held(alias, a) and held(alias, b)

    assert inside()
    assert not held(alias, a)


def test_a_force_released_member_loses_the_set_and_the_rest_is_released(alias, leave_nothing, names):
    a, b, c = names
    lk = distlocks.multi_lock(names, using=alias, wait=1)
    assert lk.acquire()
    assert force_release(alias, distlocks.lock(b, using=alias).key)
    with pytest.raises(distlocks.LockLost, match="lost"):
        lk.release()
    assert lk.hold_count == 0
    assert not held(alias, a)
    assert not held(alias, c)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ("acct:1", "names must be a list or tuple"),
        ([], "names must name at least one lock"),
        (["acct:1", ""], "names must hold non-empty str"),
        (["acct:1", 2], "names must hold non-empty str"),
        ({"acct:1"}, "names must be a list or tuple"),
    ],
)
def test_bad_names_are_refused(names, message):
    with pytest.raises(ValueError, match=message):
        distlocks.multi_lock(names)


def test_bad_wait_is_refused():
    with pytest.raises(ValueError, match="wait"):
        distlocks.multi_lock(["a"], wait=-1)
    with pytest.raises(ValueError, match="ttl"):
        distlocks.multi_lock(["a"], ttl=0)
