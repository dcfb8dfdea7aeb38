"""A separate OS process that takes part in a test: ``python -m tests.worker SCENARIO ALIAS NAME ...``.

It uses the parent's test databases (``DISTLOCKS_TEST_DATABASES``) and reports on
stdout, one line per event, so the parent can wait for "acquired" before acting.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

import distlocks  # noqa: E402
from distlocks.aio import AsyncLockAPI  # noqa: E402
from distlocks.lock import LockAPI  # noqa: E402


def say(*words: object) -> None:
    print(*words, flush=True)


def counter(alias: str, name: str, path: str, rounds: str, processes: str, locked: str = "1") -> None:
    """Increment the number in a file by read-sleep-write, under the lock (or not).

    The ``processes`` workers start their loops together, so that they overlap.
    """
    file = Path(path)
    lock = distlocks.lock(name, using=alias, ttl=30, wait=60)
    Path(f"{path}.ready.{os.getpid()}").touch()
    while len(list(file.parent.glob(f"{file.name}.ready.*"))) < int(processes):
        time.sleep(0.01)
    for _ in range(int(rounds)):
        if locked == "1":
            lock.acquire()
        value = int(file.read_text())
        time.sleep(0.002)
        # Each write replaces the file whole, so an unlocked reader never sees half
        # a number: what it loses is only whole updates.
        scratch = file.with_name(f"{file.name}.{os.getpid()}")
        scratch.write_text(str(value + 1))
        os.replace(scratch, file)
        if locked == "1":
            lock.release()
    say("done")


def async_counter(alias: str, name: str, path: str, tasks: str, rounds: str, processes: str) -> None:
    """``counter`` by ``tasks`` asyncio tasks on one loop, under ``alock``: every read-sleep-write is one update."""
    import asyncio

    file = Path(path)
    Path(f"{path}.ready.{os.getpid()}").touch()
    while len(list(file.parent.glob(f"{file.name}.ready.*"))) < int(processes):
        time.sleep(0.01)

    async def count() -> None:
        lock = distlocks.alock(name, using=alias, ttl=30, wait=60)
        for _ in range(int(rounds)):
            async with lock:
                value = int(file.read_text())
                await asyncio.sleep(0.002)  # the other tasks run meanwhile
                scratch = file.with_name(f"{file.name}.{os.getpid()}")
                scratch.write_text(str(value + 1))
                os.replace(scratch, file)

    async def main() -> None:
        await asyncio.gather(*(count() for _ in range(int(tasks))))

    asyncio.run(main())
    say("done")


def async_kind(kind: str, alias: str, name: str, path: str, tasks: str, rounds: str, processes: str) -> None:
    """``tasks`` asyncio tasks on one loop take ``kind`` (an async semaphore of 2 permits, multi-lock or write side)
    ``rounds`` times each; each logs its entry and exit to ``path`` (the semaphore) or counts in it (the others)."""
    import asyncio
    import random

    file = Path(path)
    Path(f"{path}.ready.{os.getpid()}").touch()
    while len(list(file.parent.glob(f"{file.name}.ready.*"))) < int(processes):
        time.sleep(0.01)

    def make() -> AsyncLockAPI:
        if kind == "semaphore":
            return distlocks.asemaphore(name, 2, using=alias, ttl=30, wait=60)
        if kind == "multi":
            return distlocks.amulti_lock(random.sample([f"{name}-a", f"{name}-b"], 2), using=alias, ttl=30, wait=60)
        return distlocks.aread_write_lock(name, using=alias, ttl=30, wait=60).write()

    async def take(number: int) -> None:
        lock = make()
        for _ in range(int(rounds)):
            async with lock:
                if kind == "semaphore":
                    with file.open("a") as log:
                        log.write(f"enter {os.getpid()}.{number} {time.monotonic():.6f}\n")
                    await asyncio.sleep(0.005)
                    with file.open("a") as log:
                        log.write(f"exit {os.getpid()}.{number} {time.monotonic():.6f}\n")
                    continue
                value = int(file.read_text())
                await asyncio.sleep(0.002)  # the other tasks run meanwhile
                scratch = file.with_name(f"{file.name}.{os.getpid()}")
                scratch.write_text(str(value + 1))
                os.replace(scratch, file)

    async def main() -> None:
        await asyncio.gather(*(take(number) for number in range(int(tasks))))

    asyncio.run(main())
    say("done")


def take_in_turn(alias: str, name: str, kind: str, label: str, log: str) -> None:
    """Wait for the lock in a thread (``kind`` "sync") or an asyncio task ("async"); holding it, append ``label`` to ``log``."""
    import asyncio

    def note() -> None:
        with open(log, "a") as file:
            file.write(f"{label}\n")

    if kind == "async":

        async def main() -> None:
            async with distlocks.alock(name, using=alias, wait=120):
                note()

        asyncio.run(main())
    else:
        with distlocks.lock(name, using=alias, wait=120):
            note()
    say("done")


def guarded(alias: str, name: str, seconds: str, log: str, stop: str = "") -> None:
    """Enter and leave a critical section under the lock for ``seconds`` (or until the file ``stop`` exists), logging each.

    Errors (an ensemble without quorum) are logged and retried: the parent
    checks that no two processes were ever inside at once.
    """
    lock = distlocks.lock(name, using=alias, ttl=2, wait=5)
    deadline = time.monotonic() + float(seconds)
    with open(log, "a") as events:

        def note(event: str, *more: object) -> None:
            events.write(" ".join(map(str, [event, os.getpid(), f"{time.monotonic():.3f}", *more])) + "\n")
            events.flush()

        while time.monotonic() < deadline and not (stop and os.path.exists(stop)):
            try:
                if not lock.acquire():
                    continue
                note("enter", lock.token)
                time.sleep(0.005)
                note("exit")
                lock.release()
            except distlocks.LockError as exc:
                note(f"error:{type(exc).__name__}")
                time.sleep(0.2)
    say("done")


def multi(alias: str, names: str, seconds: str, log: str) -> None:
    """Take the comma-separated ``names`` together (in the order given) in a loop (see ``_take_in_a_loop``).

    The last name in sorted order is in every set the test races: its tokens are logged, and must grow.
    """
    lock = distlocks.multi_lock(names.split(","), using=alias, ttl=5, wait=10)
    _take_in_a_loop(lock, float(seconds), log, pause=0.002, token=lambda: lock.token[-1])


def locked(alias: str, name: str, seconds: str, log: str) -> None:
    """Take the lock (``ttl`` 30 s: a hand-over missed would show as a long wait) in a loop (see ``_take_in_a_loop``)."""
    lock = distlocks.lock(name, using=alias, ttl=30, wait=10)
    _take_in_a_loop(lock, float(seconds), log, pause=0.002, token=lambda: lock.token)


def permits(alias: str, name: str, permits: str, seconds: str, log: str) -> None:
    """Take a permit of the semaphore in a loop (see ``_take_in_a_loop``)."""
    semaphore = distlocks.semaphore(name, int(permits), using=alias, ttl=5, wait=5)
    _take_in_a_loop(semaphore, float(seconds), log, pause=0.005)


def _take_in_a_loop(
    lock: LockAPI, seconds: float, log: str, pause: float, token: Callable[[], object] | None = None
) -> None:
    """Acquire, stay ``pause`` seconds, release, for ``seconds``; log each entry (with ``token()``) and exit.

    Reports how many times it was taken and how many acquires timed out (a
    deadlock between two such processes would show as timeouts).
    """
    deadline = time.monotonic() + seconds
    taken = timeouts = 0
    with open(log, "a") as events:
        while time.monotonic() < deadline:
            if not lock.acquire():
                timeouts += 1
                continue
            more = "" if token is None else f" {token()}"
            events.write(f"enter {os.getpid()} {time.monotonic():.6f}{more}\n")
            events.flush()
            time.sleep(pause)
            events.write(f"exit {os.getpid()} {time.monotonic():.6f}\n")
            events.flush()
            lock.release()
            taken += 1
    say("done", taken, timeouts)


def hold_permit(alias: str, name: str, permits: str, ttl: str) -> None:
    """Take a permit and keep it until killed."""
    semaphore = distlocks.semaphore(name, int(permits), using=alias, ttl=float(ttl), wait=60)
    semaphore.acquire()
    say("acquired", semaphore.slot, semaphore.token)
    time.sleep(3600)


def take_permit(alias: str, name: str, permits: str, wait: str) -> None:
    """Try to take a permit within ``wait`` seconds; report which one, "busy", or "mismatch"."""
    semaphore = distlocks.semaphore(name, int(permits), using=alias, ttl=30, wait=float(wait))
    try:
        if not semaphore.acquire():
            say("busy")
            return
    except ValueError:
        say("mismatch")
        return
    say("acquired", semaphore.slot, semaphore.token)
    semaphore.release()


def rw_side(alias: str, name: str, mode: str, ttl: float = 5, wait: float = 30) -> distlocks.DistributedLock:
    rw = distlocks.read_write_lock(name, using=alias, ttl=ttl, wait=wait)
    return rw.read() if mode == "read" else rw.write()


def read_together(alias: str, name: str, readers: str, folder: str) -> None:
    """Take the read side, then wait (holding it) until ``readers`` processes say in ``folder`` they hold it too."""
    side = rw_side(alias, name, "read")
    if not side.acquire():
        say("busy")
        return
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < int(readers) and time.monotonic() < deadline:
        time.sleep(0.01)
    say("together" if len(os.listdir(folder)) >= int(readers) else "alone")
    side.release()


def rw_guarded(alias: str, name: str, mode: str, seconds: str, pause: str, log: str) -> None:
    """Take the ``mode`` side in a loop for ``seconds``, holding it ``pause`` seconds, logging entries and exits."""
    side = rw_side(alias, name, mode)
    deadline = time.monotonic() + float(seconds)
    taken = timeouts = 0
    with open(log, "a") as events:
        while time.monotonic() < deadline:
            if not side.acquire():
                timeouts += 1
                continue
            events.write(f"enter {mode} {os.getpid()} {time.monotonic():.6f} {side.token}\n")
            events.flush()
            time.sleep(float(pause))
            events.write(f"exit {mode} {os.getpid()} {time.monotonic():.6f}\n")
            events.flush()
            side.release()
            taken += 1
    say("done", taken, timeouts)


def rw_turn(alias: str, name: str, mode: str, label: str, hold: str, log: str, ready: str = "") -> None:
    """Wait for the ``mode`` side; holding it ``hold`` seconds, log "enter"/"exit" with ``label`` and the time.

    With ``ready``, say "ready" first (set up, about to ask for the side).
    """
    side = rw_side(alias, name, mode, wait=60)
    if ready:
        say("ready")
    with side, open(log, "a") as events:
        events.write(f"enter {label} {time.monotonic():.6f}\n")
        events.flush()
        time.sleep(float(hold))
        events.write(f"exit {label} {time.monotonic():.6f}\n")
    say("done")


def rw_hold(alias: str, name: str, mode: str, ttl: str) -> None:
    """Take the ``mode`` side and keep it until killed."""
    side = rw_side(alias, name, mode, ttl=float(ttl), wait=60)
    side.acquire()
    say("acquired", side.token)
    time.sleep(3600)


def rw_hold_until_lost(alias: str, name: str, mode: str, ttl: str) -> None:
    """Take the ``mode`` side (renewed), then report when it is found lost and what releasing it raises."""
    until_lost(rw_side(alias, name, mode, ttl=float(ttl), wait=60))


def rw_take(alias: str, name: str, mode: str, wait: str, ttl: str = "30") -> None:
    """Try to take the ``mode`` side within ``wait`` seconds; report its token and how long it took, or "busy"."""
    side = rw_side(alias, name, mode, ttl=float(ttl), wait=float(wait))
    started = time.monotonic()
    if not side.acquire():
        say("busy")
        return
    say("acquired", side.token, f"{time.monotonic() - started:.3f}")
    side.release()


def fork(alias: str, name: str) -> None:
    """Hold a lock, fork (as gunicorn and Celery prefork do), and lock again in the child."""
    import warnings

    lock = distlocks.lock(name, using=alias, wait=0)
    lock.acquire()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        child = os.fork()
    if child == 0:
        # The child holds nothing, and gets a client of its own.
        ok = lock.hold_count == 0 and not lock.acquire(wait=0)
        other = distlocks.lock(f"{name}-child", using=alias, wait=5)
        ok = ok and other.acquire()
        other.release()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    lock.release()
    say("child", os.waitstatus_to_exitcode(status))


def hold(alias: str, name: str, ttl: str) -> None:
    """Take the lock and keep it until killed."""
    lock = distlocks.lock(name, using=alias, ttl=float(ttl), wait=60)
    lock.acquire()
    say("acquired", lock.token)
    time.sleep(3600)


def hold_until_lost(alias: str, name: str, ttl: str) -> None:
    """Take the lock (renewed), then report when it is found lost and what releasing it raises."""
    until_lost(distlocks.lock(name, using=alias, ttl=float(ttl), wait=60))


def until_lost(lock: distlocks.DistributedLock) -> None:
    """Take ``lock``, say so with its token, then report when it is found lost and what releasing it raises."""
    lock.acquire()
    say("acquired", lock.token)
    while not lock.lost:
        time.sleep(0.01)
    say("lost")
    try:
        lock.release()
        say("released")
    except distlocks.LockLost:
        say("LockLost")


def hold_kind_until_lost(kind: str, alias: str, name: str, ttl: str, idle_timeout: str = "") -> None:
    """Take ``kind`` ("lock", "semaphore" of 1 permit, "multi" of ``name``-a and -b, "alock") renewed; say "acquired",
    then "lost" with the monotonic time the holder was told, then what releasing raised.

    With ``idle_timeout``, the server ends each hold's session once it has been idle that many seconds
    (MariaDB ``wait_timeout``, PostgreSQL ``idle_session_timeout``), set on the native backend's hold connections.
    """
    import asyncio

    def end_idle_sessions() -> None:
        from distlocks.backends.db.native import _holding

        for hold in list(_holding.values()):
            with hold.connection.cursor() as cursor:
                if hold.connection.vendor == "mysql":
                    cursor.execute("SET SESSION wait_timeout = %s", [int(idle_timeout)])
                else:
                    cursor.execute("SELECT set_config('idle_session_timeout', %s, false)", [f"{idle_timeout}s"])

    if kind == "alock":

        async def main() -> None:
            lock = distlocks.alock(name, using=alias, ttl=float(ttl))
            await lock.acquire()
            if idle_timeout:
                await asyncio.to_thread(end_idle_sessions)
            say("acquired")
            while not lock.lost:
                await asyncio.sleep(0.01)
            say("lost", f"{time.monotonic():.6f}")
            try:
                await lock.release()
                say("released")
            except distlocks.LockLost:
                say("LockLost")

        asyncio.run(main())
        return
    lock: LockAPI
    if kind == "semaphore":
        lock = distlocks.semaphore(name, 1, using=alias, ttl=float(ttl))
    elif kind == "multi":
        lock = distlocks.multi_lock([f"{name}-a", f"{name}-b"], using=alias, ttl=float(ttl))
    else:
        lock = distlocks.lock(name, using=alias, ttl=float(ttl))
    lock.acquire()
    if idle_timeout:
        end_idle_sessions()
    say("acquired")
    while not lock.lost:
        time.sleep(0.01)
    say("lost", f"{time.monotonic():.6f}")
    try:
        lock.release()
        say("released")
    except distlocks.LockLost:
        say("LockLost")


def take_when(alias: str, name: str, wait: str, go: str) -> None:
    """Say "ready", then once the file ``go`` exists, ``take`` the lock."""
    say("ready")
    while not Path(go).exists():
        time.sleep(0.005)
    take(alias, name, wait)


def take_rounds(alias: str, name: str, go: str) -> None:
    """Take and release the lock again and again; before each next round, wait for the file ``go``.N.

    Each acquisition says whether this process's waiters still sleep until a release wakes them (SQLite).
    """
    from django.db import connections

    from distlocks.backends.db.wake import database_id, hears
    from distlocks.handler import locks

    database = database_id(connections[locks[alias].database])  # type: ignore[attr-defined]
    assert database is not None
    lock = distlocks.lock(name, using=alias, ttl=30, wait=60)
    for round_ in range(1_000_000):
        lock.acquire()
        lock.release()
        say("acquired", "sleeps" if hears(database) else "polls")
        while not Path(f"{go}.{round_}").exists():
            time.sleep(0.005)


def first_take(kind: str, alias: str, name: str, ttl: str) -> None:
    """This process's first lock call: take ``kind`` ("lock", "permit" of a semaphore, "multi" lock, "async" lock)
    once, wait=0, with ``ttl`` (not renewed: the acquire is what is looked at), and give it back; say whether
    the Redis driver was imported before it, then "acquired" or "busy" (or "error" and the exception)."""
    import asyncio

    imported = "imported" if "redis" in sys.modules else "fresh"
    lease = float(ttl)

    async def take_async() -> bool:
        lock = distlocks.alock(name, using=alias, ttl=lease, renew=False)
        if taken := await lock.acquire(wait=0):
            await lock.release()
        return taken

    def take_sync(lock: LockAPI) -> bool:
        if taken := lock.acquire(wait=0):
            lock.release()
        return taken

    try:
        if kind == "async":
            taken = asyncio.run(take_async())
        elif kind == "permit":
            taken = take_sync(distlocks.semaphore(name, 2, using=alias, ttl=lease, renew=False))
        elif kind == "multi":
            taken = take_sync(distlocks.multi_lock([f"{name}-a", f"{name}-b"], using=alias, ttl=lease, renew=False))
        else:
            taken = take_sync(distlocks.lock(name, using=alias, ttl=lease, renew=False))
    except distlocks.LockError as exc:
        say(imported, "error", type(exc).__name__, exc)
        return
    say(imported, "acquired" if taken else "busy")


def take(alias: str, name: str, wait: str) -> None:
    """Try to take the lock once within ``wait`` seconds and report the token."""
    lock = distlocks.lock(name, using=alias, ttl=30, wait=float(wait))
    if lock.acquire():
        say("acquired", lock.token)
        lock.release()
    else:
        say("busy")


def fenced_holder(alias: str, name: str, database: str, pk: str, ttl: str, renew: str, fenced: str, go: str) -> None:
    """Take the lock, read the stock row, wait for the file ``go`` (the parent pauses us past the lease
    meanwhile), then write the decrement: fenced, each of save(fence=) and fenced_update, or with a plain save."""
    from django.db.models import F

    from demo_shop.shop.models import Stock
    from distlocks.fencing import fenced_update

    lock = distlocks.lock(name, using=alias, ttl=float(ttl), wait=10, renew=renew == "1")
    lock.acquire()
    stock = Stock.objects.using(database).get(pk=pk)
    say("acquired", lock.token, stock.count)
    while not Path(go).exists():
        time.sleep(0.01)
    stock.count -= 1
    writes = [lambda: stock.save(fence=lock)]
    writes.append(lambda: fenced_update(Stock.objects.using(database).filter(pk=pk), lock, count=F("count") - 1))
    for write in writes if fenced == "1" else [stock.save]:
        try:
            write()
            say("written")
        except distlocks.StaleToken as exc:
            say("stale", exc.token, exc.current)
    try:
        lock.release()
        say("released")
    except distlocks.LockLost:
        say("lost")


def fenced_race(database: str, pks: str, first: str, step: str, rounds: str, start: str) -> None:
    """Write token t into every row of ``pks`` (count = t too) with fenced_update, for t = first, first + step, ...

    Starts once the file ``start`` exists, so that the racers overlap; says "ok t" or "stale t current".
    """
    from demo_shop.shop.models import Stock
    from distlocks.fencing import fenced_update

    rows = Stock.objects.using(database).filter(pk__in=pks.split(","))
    while not Path(start).exists():
        time.sleep(0.005)
    for token in range(int(first), int(first) + int(step) * int(rounds), int(step)):
        try:
            fenced_update(rows, token, count=token)
            say("ok", token)
        except distlocks.StaleToken as exc:
            say("stale", token, exc.current)


def handed_over(kind: str, url: str, name: str, ttl: str, reading: str, block: str, go: str) -> None:
    """Wait through the Redis at ``url`` (the parent's proxy) for ``kind`` with ``ttl``: a "lock", the "permit" of a
    1-permit semaphore, a read-write lock's "write" side, or on an event loop an "async-lock" or "async-write".

    Holding it, say "acquired", its token and when its own lease ends (monotonic), then "lost" once it finds the
    lease gone. The parent pauses it before it reads the hand-over: by SIGSTOP while the file ``reading`` exists
    (a thread reads the release channel: it reads what came meanwhile once it goes on), or (async) once the file
    ``block`` exists its loop spins on CPU work until the file ``go`` exists.
    """
    import asyncio

    from django.conf import settings
    from django.test import override_settings

    from distlocks.aio import _current
    from distlocks.backends.redis.handover import Releases
    from distlocks.holds import Hold, holds

    override_settings(CACHES={**settings.CACHES, "redis": {**settings.CACHES["redis"], "LOCATION": url}}).enable()
    lease = float(ttl)
    read = Releases._read

    def reading_marked(releases: Releases, timeout: float) -> None:
        Path(reading).touch()
        try:
            read(releases, timeout)
        finally:
            Path(reading).unlink()

    Releases._read = reading_marked  # type: ignore[method-assign,assignment]

    def acquired(table: dict[tuple[str, str], Hold]) -> Hold:
        [hold] = table.values()  # the semaphore's queue lock is released by now
        say("acquired", hold.token, f"{hold.lease_ends:.6f}")
        return hold

    if not kind.startswith("async"):
        if kind == "permit":
            distlocks.semaphore(name, 1, using="redis", ttl=lease, wait=60).acquire()
        elif kind == "write":
            distlocks.read_write_lock(name, using="redis", ttl=lease, wait=60).write().acquire()
        else:
            distlocks.lock(name, using="redis", ttl=lease, wait=60).acquire()
        hold = acquired(holds())
        while not hold.lost:
            time.sleep(0.01)
        say("lost", f"{time.monotonic():.6f}")
        return

    async def take() -> None:
        if kind == "async-write":
            await distlocks.aread_write_lock(name, using="redis", ttl=lease, wait=60).write().acquire()
        else:
            await distlocks.alock(name, using="redis", ttl=lease, wait=60).acquire()
        hold = acquired(_current().holds)
        while not hold.lost:
            await asyncio.sleep(0.01)
        say("lost", f"{time.monotonic():.6f}")

    async def main() -> None:
        taking = asyncio.create_task(take())
        while not os.path.exists(block):
            await asyncio.sleep(0.005)
        say("blocked")
        while not os.path.exists(go):
            sum(range(10_000))  # CPU work: the loop runs nothing else meanwhile
        await taking

    asyncio.run(main())


def queue_and_fork(alias: str, name: str, kind: str = "sync") -> None:
    """Wait for the lock in a thread (or, ``kind`` "async", in a task on a loop in a thread);
    once queued, fork a child that lives on (as a pool's worker would)."""
    import asyncio
    import threading
    import warnings

    from distlocks.backends.redis import RedisBackend
    from distlocks.handler import locks

    backend = locks[alias]
    assert isinstance(backend, RedisBackend)

    async def wait() -> None:
        await distlocks.alock(name, using=alias).acquire(wait=60)

    if kind == "async":
        threading.Thread(target=asyncio.run, args=(wait(),), daemon=True).start()
    else:
        threading.Thread(target=distlocks.lock(name, using=alias, wait=60).acquire, daemon=True).start()
    client, queue = backend.client, f"distlocks:{{{backend.make_key(name)}}}:queue"
    while not client.zcard(queue):
        time.sleep(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    say("forked", child)
    time.sleep(3600)


def lead(alias: str, name: str, ttl: str, go: str = "") -> None:
    """Say "campaigning", then lead the election ("elected TOKEN"); once the file ``go`` exists, say whether the term
    is "lost" or "leading", what ``check()`` raises, and what resigning raises. SIGTERM resigns (a clean exit)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    election = distlocks.election(name, using=alias, ttl=float(ttl))
    say("campaigning")
    try:
        with election.lead() as term:
            say("elected", term.token)
            while not (go and Path(go).exists()):
                time.sleep(0.005)
            say("lost" if term.lost else "leading")
            try:
                term.check()
                say("checked")
            except distlocks.LeadershipLost:
                say("LeadershipLost")
        say("resigned")
    except distlocks.LeadershipLost:
        say("resigned", "LeadershipLost")


def lead_until_lost(alias: str, name: str, ttl: str) -> None:
    """Lead the election ("elected TOKEN") until the term is found lost, then say what check() and resigning raise."""
    election = distlocks.election(name, using=alias, ttl=float(ttl))
    say("campaigning")
    try:
        with election.lead() as term:
            say("elected", term.token)
            while not term.lost:
                time.sleep(0.01)
            say("lost")
            try:
                term.check()
            except distlocks.LeadershipLost:
                say("LeadershipLost")
    except distlocks.LeadershipLost:
        say("resigned", "LeadershipLost")


def terms(alias: str, name: str, seconds: str, log: str) -> None:
    """Lead the election again and again for ``seconds``, each term a short one that resigns; log each term's
    "enter" (with its token) and "exit" to ``log`` (see ``conftest.guarded_events``)."""
    election = distlocks.election(name, using=alias, ttl=2)
    deadline = time.monotonic() + float(seconds)
    with open(log, "a") as events:

        def note(event: str, *more: object) -> None:
            events.write(" ".join(map(str, [event, os.getpid(), f"{time.monotonic():.3f}", *more])) + "\n")
            events.flush()

        def on_elected(term: distlocks.Term) -> None:
            note("enter", term.token)
            time.sleep(0.02)
            note("exit")

        while time.monotonic() < deadline:
            election.run(on_elected)
            time.sleep(0.01)  # the others' turn
    say("done")


def main(argv: list[str]) -> None:
    scenario, *arguments = argv
    scenarios: dict[str, Callable[..., None]] = {
        "async_counter": async_counter,
        "async_kind": async_kind,
        "counter": counter,
        "fenced_holder": fenced_holder,
        "fenced_race": fenced_race,
        "first_take": first_take,
        "fork": fork,
        "guarded": guarded,
        "handed_over": handed_over,
        "hold_permit": hold_permit,
        "locked": locked,
        "multi": multi,
        "permits": permits,
        "hold": hold,
        "hold_until_lost": hold_until_lost,
        "hold_kind_until_lost": hold_kind_until_lost,
        "lead": lead,
        "lead_until_lost": lead_until_lost,
        "queue_and_fork": queue_and_fork,
        "read_together": read_together,
        "rw_guarded": rw_guarded,
        "rw_hold": rw_hold,
        "rw_hold_until_lost": rw_hold_until_lost,
        "rw_take": rw_take,
        "rw_turn": rw_turn,
        "take": take,
        "take_rounds": take_rounds,
        "take_in_turn": take_in_turn,
        "take_when": take_when,
        "take_permit": take_permit,
        "terms": terms,
    }
    scenarios[scenario](*arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
