"""The Celery app of tests/test_celery.py: ``celery -A tests.celery_app worker``.

Broker and results live in the tests' own Redis (databases 1 and 2). Every task
writes "start"/"end" lines with its pid to a log file, so the tests can see
overlaps, and takes its lock through ``LockedTask``.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from celery import Celery  # noqa: E402

from distlocks.celery import LockedTask  # noqa: E402
from localservers import REDIS_PORT  # noqa: E402

app = Celery("tests", broker=f"redis://127.0.0.1:{REDIS_PORT}/1", backend=f"redis://127.0.0.1:{REDIS_PORT}/2")
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_queue=f"distlocks-tests-{os.environ.get('DISTLOCKS_TEST_RUN', 'run')}",
)


def note(log: str, event: str) -> None:
    with open(log, "a") as file:
        file.write(f"{event} {os.getpid()} {time.time()}\n")


def work(log: str, seconds: float) -> int:
    """Note "start", run ``seconds`` (or until the test calls ``finish_early(log)``), note "end"."""
    note(log, "start")
    ends = time.monotonic() + seconds
    while time.monotonic() < ends and not os.path.exists(f"{log}.finish"):
        time.sleep(min(0.01, max(0.0, ends - time.monotonic())))
    note(log, "end")
    return os.getpid()


def finish_early(log: str) -> None:
    """End the ``work`` of the tasks that write ``log`` now: a test that must see a task running gives it long."""
    open(f"{log}.finish", "w").close()


@app.task(base=LockedTask, lock_name="guard:{item}", lock_using="redis", lock_wait=None, lock_ttl=5)
def guarded(item: str, log: str, seconds: float = 0.2) -> int:
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="guard-db:{item}", lock_using="mariadb", lock_wait=None, lock_ttl=5)
def guarded_on_mariadb(item: str, log: str, seconds: float = 0.2) -> int:
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="skip:{item}", lock_using="redis", lock_busy="skip", lock_ttl=5)
def skipping(item: str, log: str, seconds: float = 1.0) -> int:
    return work(log, seconds)


@app.task(
    base=LockedTask,
    lock_name="retry:{item}",
    lock_using="redis",
    lock_busy="retry",
    lock_retry_countdown=0.3,
    lock_ttl=5,
    max_retries=20,  # busy retries count against it, as any retry does
)
def retrying(item: str, log: str, seconds: float = 1.0) -> int:
    return work(log, seconds)


@app.task(
    bind=True, base=LockedTask, lock_name="steps:{item}", lock_using="redis", lock_across_retries=True, lock_ttl=6
)
def in_steps(self: LockedTask, item: str, log: str, retry_queue: str) -> int:
    if self.request.retries == 0:
        note(log, "first")
        # The retry waits in a queue of its own until the test, having looked at the lock, starts its worker;
        # the lease is kept for the countdown and a ttl more: time to look on a loaded machine.
        raise self.retry(countdown=3, queue=retry_queue)
    note(log, "second")
    return int(self.request.retries)


@app.task(
    bind=True, base=LockedTask, lock_name="slow-steps:{item}", lock_using="redis", lock_across_retries=True, lock_ttl=6
)
def in_slow_steps(self: LockedTask, item: str, log: str, seconds: float = 2.0) -> int:
    if self.request.retries == 0:
        note(log, "first")
        raise self.retry(countdown=1.5)
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="fail:{item}", lock_using="redis", lock_ttl=5)
def failing(item: str) -> None:
    raise ValueError(f"{item} failed")


@app.task(base=LockedTask, lock_name="sleep:{item}", lock_using="redis", lock_wait=None, lock_ttl=3)
def sleeper(item: str, log: str, seconds: float) -> int:
    return work(log, seconds)


@app.task
def unguarded(item: str, log: str, seconds: float = 0.2) -> int:
    """The same work without a lock: it shows that the tests would see an overlap."""
    return work(log, seconds)


@app.task(base=LockedTask, lock_name=lambda item, log, seconds: f"hold:{item}", lock_using="mariadb", lock_ttl=3)
def sleeper_on_mariadb(item: str, log: str, seconds: float) -> int:
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="hold:{item}", lock_using="zookeeper", lock_ttl=3)
def sleeper_on_zookeeper(item: str, log: str, seconds: float) -> int:
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="dedupe:{item}", lock_using="redis", lock_dedupe=True, lock_ttl=5)
def deduped(item: str, log: str, seconds: float = 1.0) -> int:
    return work(log, seconds)


@app.task(base=LockedTask, lock_name="dedupe:{item}", lock_using="mariadb", lock_dedupe=True, lock_ttl=5)
def deduped_on_mariadb(item: str, log: str, seconds: float = 1.0) -> int:
    return work(log, seconds)
