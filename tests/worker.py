"""A separate OS process that takes part in a test: ``python -m tests.worker SCENARIO ALIAS NAME ...``.

It uses the parent's test databases (``DISTLOCKS_TEST_DATABASES``) and reports on
stdout, one line per event, so the parent can wait for "acquired" before acting.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

import distlocks  # noqa: E402


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


def guarded(alias: str, name: str, seconds: str, log: str) -> None:
    """Enter and leave a critical section under the lock for ``seconds``, logging each.

    Errors (an ensemble without quorum) are logged and retried: the parent
    checks that no two processes were ever inside at once.
    """
    lock = distlocks.lock(name, using=alias, ttl=2, wait=5)
    deadline = time.monotonic() + float(seconds)
    with open(log, "a") as events:

        def note(event: str) -> None:
            events.write(f"{event} {os.getpid()} {time.monotonic():.3f}\n")
            events.flush()

        while time.monotonic() < deadline:
            try:
                if not lock.acquire():
                    continue
                note("enter")
                time.sleep(0.005)
                note("exit")
                lock.release()
            except distlocks.LockError as exc:
                note(f"error:{type(exc).__name__}")
                time.sleep(0.2)
    say("done")


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


def take(alias: str, name: str, wait: str) -> None:
    """Try to take the lock once within ``wait`` seconds and report the token."""
    lock = distlocks.lock(name, using=alias, ttl=30, wait=float(wait))
    if lock.acquire():
        say("acquired", lock.token)
        lock.release()
    else:
        say("busy")


def queue_and_fork(alias: str, name: str) -> None:
    """Wait for the lock in a thread; once queued, fork a child that lives on (as a pool's worker would)."""
    import threading
    import warnings

    from distlocks.handler import locks

    lock = distlocks.lock(name, using=alias, wait=60)
    threading.Thread(target=lock.acquire, daemon=True).start()
    client, queue = locks[alias].client, f"distlocks:{{{locks[alias].make_key(name)}}}:queue"
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


if __name__ == "__main__":
    scenario, *arguments = sys.argv[1:]
    scenarios = {
        "counter": counter,
        "fork": fork,
        "guarded": guarded,
        "hold": hold,
        "queue_and_fork": queue_and_fork,
        "take": take,
    }
    scenarios[scenario](*arguments)
