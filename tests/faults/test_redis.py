"""Faults that hit the Redis backend: a stale snapshot, an evicting server, missing timeouts, passwords, odd names."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django_redis import get_redis_connection
from redis.crc import key_slot

import distlocks
from distlocks.backends.redis import strays
from distlocks.backends.redis.keys import keys_of_lock, lock_hash
from distlocks.checks import check_distlocks
from distlocks.handler import locks
from localservers import REDIS_PORT
from tests.conftest import DB, Holder, taken_by_another_thread
from tests.faults.conftest import REDIS_CACHES, FreezableProxy, frozen, scripts_run
from tests.faults.test_core import until
from tests.faults.test_interrupts import Interrupted, raising_on

pytestmark = [DB, pytest.mark.servers("redis")]

REDIS = "distlocks.backends.redis.RedisBackend"
PASSWORD = "hunter2-s3cret"


def take(name, alias="own"):
    """Acquire and release ``name`` once; return its token (retrying while the client reconnects)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with distlocks.lock(name, using=alias) as lk:
                return lk.token
        except distlocks.BackendUnavailable:
            assert time.monotonic() < deadline, "Redis did not come back"
            time.sleep(0.05)


@pytest.mark.parametrize("cache", REDIS_CACHES)
def test_tokens_keep_increasing_when_redis_restarts_from_a_stale_snapshot(own_redis, tmp_path, name, cache):
    server = own_redis(REDIS_PORT + 80, "--dir", str(tmp_path), cache=cache)
    client = locks["own"].client
    tokens = [take(name) for _ in range(3)]
    client.save()  # the snapshot: the fencing counter as it is now
    tokens += [take(name) for _ in range(5)]
    server.process.kill()  # kill -9: nothing saved since the snapshot
    server.process.wait()
    server.process = None
    server.start()
    fence = keys_of_lock(locks["own"].make_key(name))[1]
    assert int(client.get(fence)) < max(tokens)  # the counter came back, stale
    assert take(name) > max(tokens)


@pytest.mark.parametrize(("offset", "policy"), [(81, "allkeys-lru"), (82, "volatile-ttl")])  # ids alike on each worker
def test_an_evicting_redis_is_reported_by_check_and_at_first_use(own_redis, settings, caplog, name, offset, policy):
    own_redis(REDIS_PORT + offset)
    settings.DISTLOCKS = {"own": settings.DISTLOCKS["own"]}  # the checks ping this alias only
    get_redis_connection("own").config_set("maxmemory-policy", policy)
    [warning] = [message for message in check_distlocks() if message.id == "distlocks.W011"]
    assert f"DISTLOCKS['own']: the Redis of cache 'own' evicts keys (maxmemory-policy {policy})" in warning.msg
    assert "noeviction" in warning.hint
    with caplog.at_level(logging.WARNING, logger="distlocks.backends.redis"):
        take(name)
        Holder(name, "own").release()  # another thread's first use: no second warning
    logged = [record for record in caplog.records if f"maxmemory-policy {policy}" in record.getMessage()]
    assert [record.levelno for record in logged] == [logging.WARNING]


def test_a_redis_that_refuses_config_still_locks_and_checks_clean(own_redis, settings, caplog, name):
    own_redis(REDIS_PORT + 83)
    settings.DISTLOCKS = {"own": settings.DISTLOCKS["own"]}  # the checks ping this alias only
    client = get_redis_connection("own")
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.execute_command("ACL", "SETUSER", "default", "-config")  # as managed Redis services do
    assert [message.id for message in check_distlocks() if message.id.startswith("distlocks.W01")] == []
    with caplog.at_level(logging.WARNING, logger="distlocks.backends.redis"):
        assert take(name) > 0
    assert not [record for record in caplog.records if "maxmemory-policy" in record.getMessage()]


def test_check_warns_when_a_lock_cache_has_no_socket_timeouts(settings):
    def cache(options):
        return {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": f"redis://127.0.0.1:{REDIS_PORT}/0", **options}

    settings.CACHES = {
        **settings.CACHES,
        "untimed": cache({}),
        "half": cache({"OPTIONS": {"SOCKET_TIMEOUT": 5}}),
        "pooled": cache({"OPTIONS": {"CONNECTION_POOL_KWARGS": {"socket_connect_timeout": 1, "socket_timeout": 2}}}),
    }
    settings.DISTLOCKS = {alias: {"BACKEND": REDIS, "OPTIONS": {"CACHE": alias}} for alias in settings.CACHES}
    del settings.DISTLOCKS["default"]  # a LocMemCache
    warnings = {message.msg.split(" ")[0]: message for message in check_distlocks() if message.id == "distlocks.W010"}
    assert set(warnings) == {"DISTLOCKS['untimed']", "DISTLOCKS['half']"}
    assert "set no SOCKET_CONNECT_TIMEOUT and no SOCKET_TIMEOUT:" in warnings["DISTLOCKS['untimed']"].msg
    assert "set no SOCKET_CONNECT_TIMEOUT:" in warnings["DISTLOCKS['half']"].msg
    assert "OPTIONS['SOCKET_TIMEOUT']" in warnings["DISTLOCKS['half']"].hint


def test_no_password_is_printed_by_check_or_in_errors(settings):
    down = {"OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1}, "BACKEND": "django_redis.cache.RedisCache"}
    settings.CACHES = {
        **settings.CACHES,
        "secret": {**down, "LOCATION": f"redis://:{PASSWORD}@127.0.0.1:1/0"},
        "secret_user": {**down, "LOCATION": f"redis://locks:{PASSWORD}@127.0.0.1:1/1"},
        "secret_query": {**down, "LOCATION": f"redis://127.0.0.1:1/2?password={PASSWORD}&db=2"},
    }
    settings.DISTLOCKS = {
        "secret": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "secret"}},
        "secret_query": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "secret_query"}},
        "redlock": {
            "BACKEND": "distlocks.backends.redlock.RedlockBackend",
            "OPTIONS": {"CACHES": ["r1", "secret_user", "secret"]},
        },
    }
    out, err = StringIO(), StringIO()
    call_command("check", tags=["distlocks"], stdout=out, stderr=err)
    printed = out.getvalue() + err.getvalue()
    assert "Is it running at redis://:***@127.0.0.1:1/0?" in printed  # the W004 hint, masked
    assert "redis://locks:***@127.0.0.1:1/1" in printed  # Redlock's list of nodes down
    assert "redis://127.0.0.1:1/2?password=***&db=2" in printed
    errors = []
    for alias in ("secret", "redlock"):
        with pytest.raises(distlocks.BackendUnavailable) as info:
            distlocks.lock("x", using=alias).acquire(wait=0)
        errors.append(str(info.value))
    assert PASSWORD not in printed + "".join(errors)


def test_every_name_is_a_lock_of_its_own_in_one_cluster_slot(own_redis):
    own_redis(REDIS_PORT + 84)
    names = ["}", "}x", "{a}", "a}b{", "a", "\\(a\\)", "{}"]
    held = [distlocks.lock(name, using="own") for name in names]
    for lk in held:
        assert lk.acquire(wait=0)
    try:
        client, backend = get_redis_connection("own"), locks["own"]
        for lk in held:
            assert not taken_by_another_thread(distlocks.lock(lk.name, using="own"))  # each is taken
            lock_hash, fence, queue = keys_of_lock(lk.key)
            assert client.exists(lock_hash, fence) == 2
            assert key_slot(lock_hash.encode()) == key_slot(fence.encode()) == key_slot(queue.encode())
        assert len({lk.token for lk in held}) == len(names)
        assert sorted(info.key for info in backend.held()) == sorted(names)  # shown as they were given
    finally:
        for lk in held:
            lk.release()
    for name in names:
        assert taken_by_another_thread(distlocks.lock(name, using="own"))


def test_force_release_with_a_stale_token_leaves_the_next_holder_alone(name):
    backend = locks["redis"]
    first = distlocks.lock(name, using="redis")
    first.acquire()
    stale = first.token
    assert not backend.force_release(first.key, stale + 1)  # not that acquisition: left alone
    assert backend.force_release(first.key, stale)
    with pytest.raises(distlocks.LockLost):
        first.release()
    holder = Holder(name, "redis")
    assert holder.token > stale
    assert not backend.force_release(first.key, stale)  # the operator's stale view
    assert holder.release() is None  # still held until its own release: not lost


def test_a_waiter_paused_past_its_handed_over_lease_does_not_take_the_lock_from_the_next_holder(name, workers):
    import os
    import signal

    holder = distlocks.lock(name, using="redis", ttl=1)
    holder.acquire()
    waiter = workers("hold", "redis", name, 1)  # waits in the queue, then holds with ttl=1
    client, queue = locks["redis"].client, f"distlocks:{{{locks['redis'].make_key(name)}}}:queue"
    deadline = time.monotonic() + 10
    while not client.zcard(queue):
        assert time.monotonic() < deadline, "the waiter did not queue"
        time.sleep(0.01)
    os.kill(waiter.process.pid, signal.SIGSTOP)  # a GC pause, a VM migration
    try:
        holder.release()  # handed over to the paused waiter: its lease runs out unrenewed
        time.sleep(1.5)
        next_holder = Holder(name, "redis", ttl=5)
    finally:
        os.kill(waiter.process.pid, signal.SIGCONT)
    time.sleep(1)  # the waiter wakes to the old hand-over meanwhile
    assert next_holder.release() is None  # nobody took it from under it
    event, token = waiter.line()
    assert event == "acquired"
    assert int(token) > next_holder.token


# Less than a third of the 9 s lease, and of the longest a read-write waiter waits before it asks again (3 s):
# the waiter trusts the hand-over it reads after this pause without asking again.
HAND_OVER_TTL, PAUSE = 9, 1.5


def same_kind(kind, name):
    """A new lock object of ``kind`` (as ``tests.worker handed_over`` takes it) on the alias "redis"."""
    if kind.endswith("permit"):
        return distlocks.semaphore(name, 1, using="redis", ttl=HAND_OVER_TTL)
    if kind.endswith("write"):
        return distlocks.read_write_lock(name, using="redis", ttl=HAND_OVER_TTL).write()
    return distlocks.lock(name, using="redis", ttl=HAND_OVER_TTL)


def stopped_while(pid, condition):
    """SIGSTOP ``pid`` at a moment ``condition()`` holds (it still holds while the process is stopped)."""
    while True:
        until(condition)
        os.kill(pid, signal.SIGSTOP)
        if condition():
            return
        os.kill(pid, signal.SIGCONT)


def handed_over_while_paused(workers, tmp_path, name, kind):
    """A waiter process (``kind``, through a proxy) is handed the lock while paused for less than a third of its
    lease, and cut off from Redis just before it goes on; the test takes the lock once the server's lease ends.

    The waiter must count its lease from before the hand-over, so that it believes it holds the lock no longer
    than the server keeps it: it reports the end of its lease, which must come before the test's take.
    """
    proxy = FreezableProxy(REDIS_PORT)
    reading, block, go = tmp_path / "reading", tmp_path / "block", tmp_path / "go"
    holding = same_kind(kind, name)
    assert holding.acquire(wait=0)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    waiter = workers("handed_over", kind, url, name, HAND_OVER_TTL, reading, block, go)
    pid = waiter.process.pid
    client = locks["redis"].client
    queued = lambda: any(client.zcard(queue) for queue in client.scan_iter(match=f"*{name}*:queue"))  # noqa: E731
    try:
        if kind.startswith("async"):
            until(queued)
            block.touch()
            assert waiter.line() == ["blocked"]  # its event loop runs nothing now
        else:
            stopped_while(pid, lambda: queued() and reading.exists())  # a GC pause, a VM migration
        holding.release()  # handed over to the paused waiter: the server's lease starts now
        slot = holding.slots[0] if kind.endswith("permit") else holding
        handed = slot.holder()
        assert handed is not None, "the release handed the lock to nobody"
        time.sleep(PAUSE)  # the fault: the waiter reads the hand-over this much later
        with proxy.frozen(most=30):
            if kind.startswith("async"):
                go.touch()
            else:
                os.kill(pid, signal.SIGCONT)
            event, token, lease_ends = waiter.line()
            assert (event, int(token)) == ("acquired", handed.token)
            taking = same_kind(kind, name)
            assert taking.acquire(wait=3 * HAND_OVER_TTL)  # once the server's lease has run out
            taken_at = time.monotonic()
            assert float(lease_ends) <= taken_at, (
                f"the waiter believes it holds the lock {float(lease_ends) - taken_at:.2f}s after another took it"
            )
            assert waiter.line()[0] == "lost"
            taking.release()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it ended by itself once it found its lease gone
            os.kill(pid, signal.SIGCONT)
        proxy.close()


@pytest.mark.parametrize("alias", ["redis"])
@pytest.mark.parametrize("kind", ["lock", "permit", "write"])
def test_a_waiter_paused_before_it_reads_its_hand_over_counts_its_lease_from_before_it(
    workers, tmp_path, name, kind, leave_nothing
):
    handed_over_while_paused(workers, tmp_path, name, kind)


def voided(name):
    """Wait until this process has voided every acquire of ``name`` whose answer it lost (the server answered)."""
    lock_name = lock_hash(locks["own"].make_key(name))
    deadline = time.monotonic() + 30
    while any(stray.keys[0] == lock_name for stray in strays.pending()):
        assert time.monotonic() < deadline, "the lost acquires were not voided"
        time.sleep(0.02)


# What BackendUnavailable says of a call that got no answer in time: the cache, the alias, the driver's error.
TIMED_OUT = r"Redis of cache 'own' \(redis://127\.0\.0\.1:\d+/0\) for locks on 'own' is unavailable: Timeout "


def timed_out_acquire(server, lk, call="acquire"):
    """Send ``lk``'s acquire (or ``take_detached``) to the frozen ``server``: the client gives up after its
    0.5 s socket timeout, and the server runs the script once it goes on."""
    send = (lambda: lk.acquire(wait=0)) if call == "acquire" else (lambda: lk.take_detached(30))
    with frozen(server), pytest.raises(distlocks.BackendUnavailable, match=TIMED_OUT):
        send()


def proxied_alias(settings, server):
    """Make lock alias "proxied": ``server`` (alias "own") reached through a FreezableProxy; return the proxy."""
    proxy = FreezableProxy(server.port)
    proxied = {**settings.CACHES["own"], "LOCATION": f"redis://127.0.0.1:{proxy.port}/0"}
    settings.CACHES = {**settings.CACHES, "proxied": proxied}
    settings.DISTLOCKS = {**settings.DISTLOCKS, "proxied": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "proxied"}}}
    return proxy


def taken_elsewhere(name, wait):
    """Whether another thread takes the lock ``name`` on the alias "own" within ``wait`` seconds."""
    return taken_by_another_thread(distlocks.lock(name, using="own", ttl=30), wait)


@pytest.mark.parametrize("cache", REDIS_CACHES)
def test_an_acquire_run_after_its_client_gave_up_does_not_keep_the_lock_for_its_ttl(own_redis, name, caplog, cache):
    server = own_redis(REDIS_PORT + 60, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5, cache=cache)
    lk = distlocks.lock(name, using="own", ttl=30)
    with lk:
        pass  # its connection is open: the frozen server's kernel takes the request, run when the server goes on
    with caplog.at_level(logging.INFO, logger="distlocks.backends.redis"):
        timed_out_acquire(server, lk)
        assert lk.hold_count == 0
        # Before the fix, the script took the lock for 30 s for an owner told it did not get it.
        assert taken_elsewhere(name, wait=5)
        voided(name)
    assert "taken by an acquire whose answer was lost" in caplog.text  # it ran, and was given back
    assert lk.acquire(wait=0)  # the same owner too
    lk.release()


def test_a_long_outage_keeps_at_most_max_pending_voids_dropping_the_oldest(own_redis, name, monkeypatch, caplog):
    """Voids wait in a bounded backlog per server: past it the oldest is dropped (its lease ends its hold)."""
    monkeypatch.setattr(strays, "MAX_PENDING", 2)
    server = own_redis(REDIS_PORT + 69, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    names = [f"{name}-{i}" for i in range(3)]
    locks_ = [distlocks.lock(n, using="own", ttl=30) for n in names]
    for lk in locks_:
        with lk:
            pass  # connections open: the frozen server's kernel takes the requests
    with frozen(server), caplog.at_level(logging.WARNING, logger="distlocks.backends.redis"):
        for lk in locks_:
            with pytest.raises(distlocks.BackendUnavailable):
                lk.acquire(wait=0)
        ours = {lock_hash(locks["own"].make_key(n)) for n in names}
        assert sorted(stray.keys[0] for stray in strays.pending() if stray.keys[0] in ours) == sorted(
            lock_hash(locks["own"].make_key(n)) for n in names[1:]
        )
    assert "Too many lost acquires to void" in caplog.text
    for n in names:
        voided(n)
    # The kept ones were voided. The dropped one is no longer tried; a void of it already in flight when
    # it was dropped (the voids' thread tries the oldest first) may still have freed it, so it is not asserted.
    assert [taken_elsewhere(n, wait=0) for n in names[1:]] == [True, True]


def test_a_lost_acquire_leaves_the_hold_its_owner_had_already(own_redis, name):
    """The same owner held the lock (re-entrant, or detached): the acquire it lost found it held, and its void
    leaves the hold, with its count and token."""
    server = own_redis(REDIS_PORT + 61, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    lk = distlocks.lock(name, using="own", ttl=30)
    assert lk.acquire(wait=0)
    lk.acquire()  # held twice
    token = lk.token
    timed_out_acquire(server, lk, call="take_detached")  # the same owner's acquire script
    voided(name)
    holder = lk.holder()
    assert (holder.token, holder.hold_count) == (token, 2)
    assert not taken_elsewhere(name, wait=0)
    lk.release()
    assert not taken_elsewhere(name, wait=0)
    lk.release()  # no LockLost: the hold was never taken away
    assert taken_elsewhere(name, wait=0)


def test_a_lost_acquire_leaves_another_owners_hold(own_redis, name):
    server = own_redis(REDIS_PORT + 62, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    holder = Holder(name, "own", ttl=30)
    lk = distlocks.lock(name, using="own", ttl=30)
    assert not lk.acquire(wait=0)  # opens the connection
    timed_out_acquire(server, lk)
    voided(name)
    assert lk.holder().token == holder.token
    assert not lk.acquire(wait=0)
    assert holder.release() is None  # released, not lost
    assert lk.acquire(wait=0)
    lk.release()


SIDES_OF_LOCKS = {
    "lock": lambda name: distlocks.lock(name, using="own", ttl=30),
    "read side": lambda name: distlocks.read_write_lock(name, using="own", ttl=30).read(),
    "write side": lambda name: distlocks.read_write_lock(name, using="own", ttl=30).write(),
}


def writable_elsewhere(name, kind):
    """Whether another thread takes at once what excludes ``kind``: the lock, or the read-write lock's write side."""
    return taken_by_another_thread(SIDES_OF_LOCKS["lock" if kind == "lock" else "write side"](name))


@pytest.mark.parametrize("cache", REDIS_CACHES)
@pytest.mark.parametrize("kind", SIDES_OF_LOCKS)  # the sides differ in their scripts only
def test_a_lost_acquire_that_redis_py_sends_again_takes_what_its_first_run_took(own_redis, settings, name, kind, cache):
    """A cache whose connections retry on a timeout (``retry_on_timeout``, a ``Retry``) sends the acquire script
    again, with the same attempt id, when its answer was lost. The first run took the lock: the second one must
    say so, or the owner is told it did not get the lock, nothing is voided (no error was raised), and the first
    run's hold keeps the lock from everyone for its ttl."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    server = own_redis(
        REDIS_PORT + 63,
        SOCKET_CONNECT_TIMEOUT=1,
        SOCKET_TIMEOUT=2,  # the answer after the retry must come in time on a loaded machine
        CONNECTION_POOL_KWARGS={"retry": Retry(NoBackoff(), 1)},
        cache=cache,
    )
    proxy = FreezableProxy(server.port)
    settings.CACHES = {
        **settings.CACHES,
        "own": {**settings.CACHES["own"], "LOCATION": f"redis://127.0.0.1:{proxy.port}/0"},
    }
    try:
        lk = SIDES_OF_LOCKS[kind](name)
        with lk:
            pass  # a connection open through the proxy
        connections = len(proxy.sockets)

        def thaw_at_the_retry():
            # The answer is lost (2 s socket timeout): redis-py reconnects to send the script again.
            deadline = time.monotonic() + 10
            while len(proxy.sockets) == connections and time.monotonic() < deadline:
                time.sleep(0.01)
            proxy.flowing.set()

        proxy.flowing.clear()
        thawing = threading.Thread(target=thaw_at_the_retry)
        thawing.start()
        scripts_before = scripts_run(server)
        acquired = lk.acquire(wait=0)
        thawing.join(15)
        assert len(proxy.sockets) > connections, "redis-py did not retry"
        # Both runs reach the server before the test goes on: the first, held by the proxy, could otherwise come
        # after the release and take the lock again (a copy delayed past the release; see ``strays``).
        until(lambda: scripts_run(server) >= scripts_before + 2)
        # Before the fix: the second run found the lock held (by the first) and said "not acquired".
        assert acquired
        assert lk.hold_count == 1
        assert not writable_elsewhere(name, kind)
        lk.release()
        assert writable_elsewhere(name, kind)  # before the fix, a read side's second run held it once more
    finally:
        proxy.close()


@pytest.mark.parametrize("cache", REDIS_CACHES)
@pytest.mark.parametrize("waiter", ["thread", "task"])
def test_a_hand_over_published_to_a_black_holed_release_channel_reaches_its_waiter_long_before_the_lease(
    own_redis, settings, name, waiter, cache
):
    """A release channel dropped without a reset (a NAT, a firewall) reads nothing: pinged, it is found dead
    and resubscribed, and the waiter takes the lock handed to it then, not when its 30 s lease runs out."""
    server = own_redis(REDIS_PORT + 70 + (waiter == "task"), SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=1, cache=cache)
    proxy = proxied_alias(settings, server)
    client = locks["own"].client
    queue = keys_of_lock(locks["own"].make_key(name))[2]
    holder = distlocks.lock(name, using="own", ttl=30)
    assert holder.acquire(wait=0)
    taken = []

    def take():  # through the proxy
        if waiter == "thread":
            with distlocks.lock(name, using="proxied", ttl=30, wait=60):
                taken.append(time.monotonic())
            return

        async def main():
            async with distlocks.alock(name, using="proxied", ttl=30, wait=60):
                taken.append(time.monotonic())

        asyncio.run(main())

    thread = threading.Thread(target=take)
    thread.start()
    try:
        until(lambda: client.zcard(queue) == 1)  # queued, its process's channel subscribed
        proxy.stall_to({entry["addr"] for entry in client.client_list(_type="pubsub")})  # that channel alone
        released = time.monotonic()
        holder.release()
        thread.join(60)
        assert taken, "the waiter did not get the lock"
        assert taken[0] - released < 10, f"the waiter took the lock {taken[0] - released:.1f}s after its release"
    finally:
        proxy.close()
        thread.join(60)


@pytest.mark.parametrize("cache", REDIS_CACHES)
@pytest.mark.parametrize("fault", ["interrupt", "timeout"])
def test_a_release_that_never_reached_a_frozen_server_frees_the_lock_once_it_answers(own_redis, name, fault, cache):
    """A release interrupted (a raising signal handler: Celery's soft time limit) or timed out while it opened a
    connection to a frozen server was never sent: it is made again once the server answers, not left to the lease."""
    server = own_redis(
        REDIS_PORT + 72 + (fault == "timeout"), SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5, cache=cache
    )
    lk = distlocks.lock(name, using="own", ttl=30)
    assert lk.acquire(wait=0)
    locks["own"].client.connection_pool.disconnect()  # the release opens a connection: its handshake waits
    with frozen(server):
        if fault == "timeout":
            with pytest.raises(distlocks.BackendUnavailable, match=TIMED_OUT):
                lk.release()
        else:
            with raising_on(signal.SIGALRM):
                signal.setitimer(signal.ITIMER_REAL, 0.2)  # within the handshake's 0.5 s socket timeout
                try:
                    with pytest.raises(Interrupted):
                        lk.release()
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
    assert lk.hold_count == 0
    until(lambda: taken_by_another_thread(distlocks.lock(name, using="own")), seconds=5)  # not after its 30 s lease


def test_a_release_that_reaches_the_server_late_leaves_its_owners_next_acquisition_alone(own_redis, settings, name):
    """A thread's release stuck on a connection (a frozen proxy) times out; its lease runs out, and the thread
    takes the lock again on another connection. When the old release arrives, it must not free the new hold,
    which belongs to the same owner (a thread keeps its secret): another thread would get in silently."""
    server = own_redis(REDIS_PORT + 74, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=0.5)
    proxy = proxied_alias(settings, server)
    client = locks["own"].client
    first = distlocks.lock(name, using="proxied", ttl=1, renew=False)
    again = distlocks.lock(name, using="own", ttl=30)
    try:
        with again:
            pass  # the release script is loaded: the old release will run, not fail with NOSCRIPT
        assert first.acquire(wait=0)
        # The proxy's connection to Redis that the release will use (the one the acquire used).
        stale = {"{}:{}".format(*sock.getsockname()) for sock in proxy.sockets[2::2]}
        with proxy.frozen():
            with pytest.raises(distlocks.BackendUnavailable):
                first.release()  # sent, and held by the proxy; its client gives up on the connection
            assert again.acquire(wait=10)  # on another connection, once the first lease has run out
        # Thawed: the old release runs, then its connection ends.
        until(lambda: not stale & {entry["addr"] for entry in client.client_list()})
        assert client.hget(lock_hash(again.key), "token") == str(again.token).encode()
        assert not taken_by_another_thread(distlocks.lock(name, using="own"))
        assert not again.lost
        again.release()
    finally:
        proxy.close()


def test_a_renewal_that_reaches_the_server_late_leaves_its_owners_next_lease_alone(own_redis, settings, name):
    """The watchdog's renewal of a lease, stuck on a connection (a frozen proxy) until the lease was lost and the
    thread took the lock again, must not cut the new, longer lease when it arrives: it would run out while the
    thread (same owner, same secret) still believes it holds the lock."""
    server = own_redis(REDIS_PORT + 75, SOCKET_CONNECT_TIMEOUT=1, SOCKET_TIMEOUT=2)
    proxy = proxied_alias(settings, server)
    client = locks["own"].client
    first = distlocks.lock(name, using="proxied", ttl=1.5)  # renewed through the proxy
    again = distlocks.lock(name, using="own", ttl=30, renew=False)
    try:
        assert not again.extend_detached(1)  # the renewal's script is loaded: it will run late, not fail
        assert first.acquire(wait=0)
        with proxy.frozen():
            until(lambda: first.lost)  # its renewal is held by the proxy
            with pytest.raises(distlocks.LockLost):
                first.release()  # (its clean-up opens a connection: its handshake times out, nothing is sent)
            assert again.acquire(wait=10)
            before = scripts_run(server)
        # Thawed: the late renewal runs.
        until(lambda: scripts_run(server) > before)
        assert client.pttl(lock_hash(again.key)) > 25_000
        assert not taken_by_another_thread(distlocks.lock(name, using="own"))
        again.release()
    finally:
        proxy.close()
