"""The semaphore on every backend: never more than ``permits`` processes inside, each permit a lease."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

import distlocks
from distlocks.handler import locks
from distlocks.inspection import force_release, held_locks
from distlocks.semaphore import _agreed

from .conftest import DB, NATIVE_ALIASES, PROCESS_ALIASES
from .test_lock import in_thread

pytestmark = DB
# Backends that record a semaphore's permits count (the native database locks do not: see the README).
RECORDING_ALIASES = [alias for alias in PROCESS_ALIASES if alias not in NATIVE_ALIASES]


def concurrency(log):
    """The most processes inside at once, and how many entries each process made, from the events in ``log``."""
    events = []
    for line in log.read_text().splitlines():
        event, pid, at = line.split()
        # At one instant an exit counts before an entry: the intervals are inside the holds.
        events.append((float(at), 0 if event == "exit" else 1, pid))
    inside = most = 0
    entries = Counter()
    for _, entering, pid in sorted(events):
        inside += 1 if entering else -1
        most = max(most, inside)
        if entering:
            entries[pid] += 1
    return most, entries


def take_one(sem):
    """Take a permit, give it back, and say which it was."""
    assert sem.acquire()
    slot = sem.slot
    sem.release()
    return slot


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_never_more_than_permits_processes_inside(alias, leave_nothing, name, workers, tmp_path):
    log = tmp_path / "events"
    running = [workers("permits", alias, name, 2, 4, log) for _ in range(4)]
    results = [worker.finish() for worker in running]
    most, entries = concurrency(log)
    assert most == 2  # never 3, and the permits were really used together
    assert len(entries) == 4  # every process got in
    for done, taken, timeouts in results:
        assert done == "done"
        assert int(taken) > 0
        assert int(timeouts) == 0


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_a_sigkilled_holders_permit_comes_back(alias, leave_nothing, name, workers):
    holders = [workers("hold_permit", alias, name, 2, 1) for _ in range(2)]
    slots = {worker: worker.line() for worker in holders}
    assert sorted(int(line[1]) for line in slots.values()) == [0, 1]
    assert workers("take_permit", alias, name, 2, 0).finish() == ["busy"]
    victim, survivor = holders
    victim.kill()
    killed = time.monotonic()
    answer = workers("take_permit", alias, name, 2, 10).finish()
    assert answer[:2] == ["acquired", slots[victim][1]]  # the killed holder's permit, freed
    assert int(answer[2]) > int(slots[victim][2])  # with a larger token
    assert time.monotonic() - killed < 10
    assert survivor.process.poll() is None


def test_the_lock_api_and_readable_names(alias, leave_nothing, name):
    sem = distlocks.semaphore(name, 2, using=alias, wait=0)
    with pytest.raises(distlocks.LockNotOwned):
        sem.token  # noqa: B018
    with sem as permit:
        assert permit is sem
        with sem:  # reentrant: the same permit, held twice
            assert sem.hold_count == 2
        shown = {info.key: info for info in held_locks([alias]).locks}
        key = sem.slots[sem.slot].key
        assert key.endswith(f"sem:{name}#{sem.slot}")
        assert shown[key].token == permit.token
        assert shown[key].owner.endswith("task permits=2")
        assert in_thread(lambda: take_one(sem)) == 1 - sem.slot  # the other permit, in another thread
    with pytest.raises(distlocks.LockNotOwned):
        sem.release()

    @distlocks.semaphore(name, 2, using=alias, wait=0)
    def inside():
        return True

    assert inside()


def test_a_full_semaphore_gives_no_permit_and_waiters_get_one_in_turn(alias, leave_nothing, name):
    sem = distlocks.semaphore(name, 1, using=alias, wait=0)
    assert sem.acquire()
    got = []

    def waiter(label):
        with distlocks.semaphore(name, 1, using=alias, wait=20):
            got.append(label)

    assert in_thread(lambda: distlocks.semaphore(name, 1, using=alias).acquire(wait=0.2)) is False
    threads = [threading.Thread(target=waiter, args=(label,)) for label in range(3)]
    for thread in threads:
        thread.start()
    sem.release()
    for thread in threads:
        thread.join(30)
    assert sorted(got) == [0, 1, 2]


def test_a_force_released_permit_is_lost(alias, leave_nothing, name):
    sem = distlocks.semaphore(name, 2, using=alias, wait=0)
    assert sem.acquire()
    assert force_release(alias, sem.slots[sem.slot].key)
    with pytest.raises(distlocks.LockLost):
        sem.release()


@pytest.mark.parametrize("alias", RECORDING_ALIASES, indirect=True)
def test_a_permits_mismatch_raises_even_when_nobody_holds_a_permit(alias, leave_nothing, name, workers):
    assert workers("take_permit", alias, name, 2, 5).finish()[0] == "acquired"
    with pytest.raises(ValueError, match="permits is 3, but semaphore .* is in use with permits=2"):
        distlocks.semaphore(name, 3, using=alias, wait=0).acquire()
    assert workers("take_permit", alias, name, 3, 0).finish() == ["mismatch"]
    assert workers("take_permit", alias, name, 2, 0).finish()[0] == "acquired"


@pytest.mark.parametrize("alias", RECORDING_ALIASES, indirect=True)
def test_a_permits_mismatch_raises_when_the_permits_are_taken(alias, leave_nothing, name, workers):
    for _ in range(2):
        assert workers("hold_permit", alias, name, 2, 5).line()[0] == "acquired"
    for permits in (1, 3):
        with pytest.raises(ValueError, match=f"permits is {permits}, but"):
            distlocks.semaphore(name, permits, using=alias, wait=1).acquire()
    # The check is also made by the holders' labels, when every permit is taken.
    _agreed.clear()
    marker = distlocks.semaphore(name, 1, using=alias).marker
    if marker.session_bound:
        locks[alias].clear_expired()  # ZooKeeper's marker is a node that cleanup deletes
    else:
        assert force_release(alias, marker.key)
    with pytest.raises(ValueError, match="permits is 1, but"):
        distlocks.semaphore(name, 1, using=alias, wait=1).acquire()


@pytest.mark.parametrize(
    ("permits", "message"),
    [
        (0, "permits must be a positive int, not 0"),
        (-1, "permits must be"),
        (2.0, "not float"),
        (True, "not bool"),
        (1001, "at most 1000"),
    ],
)
def test_bad_permits_are_refused(permits, message):
    with pytest.raises(ValueError, match=message):
        distlocks.semaphore("exports", permits)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="name"):
        distlocks.semaphore("", 1)
    with pytest.raises(ValueError, match="name"):
        distlocks.semaphore(None, 1)
    with pytest.raises(ValueError, match="wait"):
        distlocks.semaphore("exports", 1, wait=-1)
    with pytest.raises(ValueError, match="ttl"):
        distlocks.semaphore("exports", 1, ttl=0)


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_the_last_free_permit_of_many_is_found(alias, leave_nothing, name, workers):
    # A caller tries 3 permits before it queues: the others are found all the same.
    held = {workers("hold_permit", alias, name, 5, 5).line()[1] for _ in range(4)}
    free = ({"0", "1", "2", "3", "4"} - held).pop()
    for wait in (0, 2):
        assert workers("take_permit", alias, name, 5, wait).finish()[:2] == ["acquired", free]
    workers("hold_permit", alias, name, 5, 5).line()
    assert workers("take_permit", alias, name, 5, 0).finish() == ["busy"]


def listed(alias, name):
    """What ``distlocks_list`` and the admin show of the semaphore ``name`` (both list ``held_locks``)."""
    return [info for info in held_locks([alias]).locks if name in info.key]


@pytest.mark.parametrize("alias", PROCESS_ALIASES, indirect=True)
def test_after_a_holders_sigkill_the_listing_shows_only_the_permits_really_held(alias, leave_nothing, name, workers):
    """Before, the permits record (a lease every user renews, 10 minutes long) stayed listed as a semaphore hold,
    owned by the process that took it first, long after that process was killed and its permit ran out."""
    holder = workers("hold_permit", alias, name, 2, 2)  # a 2 s lease (ZooKeeper: its 4 s session)
    assert holder.line()[0] == "acquired"
    sem = distlocks.semaphore(name, 2, using=alias, ttl=30)
    with sem:
        assert sorted(info.key for info in listed(alias, name)) == [permit.key for permit in sem.slots]
        holder.kill()
        deadline = time.monotonic() + 30
        while len(listed(alias, name)) > 1:
            assert time.monotonic() < deadline, listed(alias, name)
            time.sleep(0.05)
        [mine] = listed(alias, name)
        assert (mine.key, mine.token, mine.kind) == (sem.slots[sem.slot].key, sem.token, "semaphore")
    assert listed(alias, name) == []
    if alias in RECORDING_ALIASES:  # the record is still there, doing its work
        with pytest.raises(ValueError, match="permits is 3, but"):
            distlocks.semaphore(name, 3, using=alias, wait=0).acquire()
