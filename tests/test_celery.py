"""LockedTask with real Celery workers on a real broker (the tests' own Redis)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError, TimeLimitExceeded
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.celery import TOKEN_HEADER, LockedTask
from distlocks.handler import locks
from distlocks.owner import task_owner
from tests.celery_app import (
    app,
    deduped,
    deduped_on_mariadb,
    failing,
    finish_early,
    guarded,
    guarded_on_mariadb,
    in_slow_steps,
    in_steps,
    retrying,
    skipping,
    sleeper,
    sleeper_on_mariadb,
    sleeper_on_zookeeper,
    unguarded,
)

from .conftest import DB, ROOT, wait_until, worker_env

pytestmark = [DB, pytest.mark.timeout(120), pytest.mark.servers("redis", "zookeeper")]


class CeleryWorker:
    """``celery worker`` in a process group of its own, stopped or SIGKILLed by the test."""

    def __init__(self, concurrency: int = 2, *options: str) -> None:
        self.name = f"w-{uuid.uuid4().hex[:8]}@distlocks-tests"
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "--pool=prefork",
            f"--concurrency={concurrency}", "-n", self.name, "--without-gossip", "--without-mingle",
            "--without-heartbeat", "--loglevel=WARNING", *options,
        ]  # fmt: skip
        # No system checks: the test settings name databases that are down on purpose.
        # PYTHONFAULTHANDLER: a worker that crashes prints where.
        env = {**worker_env(), "CELERY_SKIP_CHECKS": "1", "PYTHONFAULTHANDLER": "1"}
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        try:
            while not app.control.ping(destination=[self.name], timeout=0.5):
                assert self.process.poll() is None, f"celery worker exited with {self.process.returncode}"
                assert time.monotonic() < deadline, "celery worker did not answer within 60 s"
        except BaseException:
            self.kill()  # no fixture knows of it yet
            raise

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone once all of it has ended
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Ask for a cold shutdown (SIGQUIT: the tests' tasks are done); ``wait()`` for it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGQUIT)

    def wait(self) -> None:
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def celery_workers():
    started = []

    def start(count=1, concurrency=2, *options):
        for _ in range(count):
            started.append(CeleryWorker(concurrency, *options))
        return started[-count:]

    yield start
    for worker in started:
        worker.stop()
    for worker in started:
        worker.wait()


@pytest.fixture(scope="module")
def pair(django_db_setup, redis_servers):  # the broker is the tests' Redis: up before the workers
    """Two workers of two processes each, shared by the tests that neither kill nor configure them."""
    started = [CeleryWorker(2), CeleryWorker(2)]
    yield started
    for worker in started:
        worker.stop()
    for worker in started:
        worker.wait()


@pytest.fixture
def log(tmp_path):
    return str(tmp_path / "events.log")


def events(log):
    with open(log) as file:
        return [line.split() for line in file]


def overlapped(log):
    kinds = [event for event, *_ in events(log)]
    return kinds != ["start", "end"] * (len(kinds) // 2)


def assert_never_overlapped(log):
    assert not overlapped(log), events(log)


def held(alias, name):
    key = locks[alias].make_key(name)
    return next((info for info in locks[alias].held() if info.key == key), None)


@pytest.mark.parametrize("task", [guarded, guarded_on_mariadb])
def test_two_workers_racing_never_overlap(pair, log, name, task):
    workers = pair
    results = [task.delay(name, log, 0.1) for _ in range(8)]
    pids = {result.get(timeout=60) for result in results}
    assert_never_overlapped(log)
    assert len(events(log)) == 16
    assert len(pids) >= 2, "both workers' processes ran some"
    assert {worker.process.poll() for worker in workers} == {None}
    # The same work without the lock does overlap on these workers: the check above can fail.
    unlocked = f"{log}.unlocked"
    for result in [unguarded.delay(name, unlocked, 0.1) for _ in range(8)]:
        result.get(timeout=60)
    assert overlapped(unlocked)


def test_skip_is_recorded_as_the_result(pair, log, name):
    first = skipping.delay(name, log, 2.0)
    wait_until(lambda: held("redis", f"skip:{name}") is not None)
    second = skipping.delay(name, log, 0)
    assert second.get(timeout=30) == {"skipped": True, "reason": "lock busy", "lock": f"skip:{name}", "using": "redis"}
    assert second.state == "SUCCESS"
    assert isinstance(first.get(timeout=30), int)
    assert len(events(log)) == 2  # only the first ran


def test_retry_runs_it_later(pair, log, name):
    first = retrying.delay(name, log, 1.0)
    wait_until(lambda: held("redis", f"retry:{name}") is not None)
    second = retrying.delay(name, log, 0)
    first.get(timeout=30)
    second.get(timeout=30)
    assert_never_overlapped(log)
    assert len(events(log)) == 4  # both ran, one after the other


def test_the_lock_is_held_across_the_tasks_own_retries(celery_workers, log, name, workers):
    # The retry runs in another worker than the first try, started once the test has looked at the lock.
    queue = f"q-{name}"  # its own queue: the shared workers must not take it
    celery_workers(1, 1, "-Q", queue)
    result = in_steps.apply_async((name, log, f"{queue}-retry"), queue=queue)
    wait_until(lambda: os.path.exists(log) and [event for event, *_ in events(log)] == ["first"])
    # Between the two executions nobody else gets the lock.
    assert "task " + result.id in held("redis", f"steps:{name}").owner
    assert workers("take", "redis", f"steps:{name}", 0).finish() == ["busy"]
    celery_workers(1, 1, "-Q", f"{queue}-retry")
    assert result.get(timeout=30) == 1
    (first, first_pid, _), (second, second_pid, _) = events(log)
    assert (first, second) == ("first", "second")
    assert first_pid != second_pid
    assert held("redis", f"steps:{name}") is None
    assert workers("take", "redis", f"steps:{name}", 0).finish()[0] == "acquired"


def test_a_retry_delivered_twice_runs_its_copies_one_at_a_time(celery_workers, log, name):
    queue = f"q-{name}"
    celery_workers(1, 2, "-Q", queue)  # two processes: the copies could run at once
    result = in_slow_steps.apply_async((name, log), queue=queue)
    wait_until(lambda: os.path.exists(log) and [event for event, *_ in events(log)] == ["first"])
    token = held("redis", f"slow-steps:{name}").token
    # The retry delivered once more, as acks_late with a visibility timeout
    # shorter than the countdown does: same task id, same kept token.
    in_slow_steps.apply_async((name, log), task_id=result.id, retries=1, headers={TOKEN_HEADER: token}, queue=queue)
    wait_until(lambda: [event for event, *_ in events(log)].count("end") == 2, timeout=30)
    assert [event for event, *_ in events(log)] == ["first", "start", "end", "start", "end"]
    wait_until(lambda: held("redis", f"slow-steps:{name}") is None)


def test_released_on_failure(pair, name):
    with pytest.raises(ValueError, match="failed"):
        failing.delay(name).get(timeout=30)
    assert held("redis", f"fail:{name}") is None


def test_the_holder_shows_its_task_id_and_is_released_on_revoke(pair, log, name):
    result = sleeper.delay(name, log, 30)
    wait_until(lambda: held("redis", f"sleep:{name}") is not None)
    assert held("redis", f"sleep:{name}").owner.endswith(f" task {result.id}")
    started = time.monotonic()
    result.revoke(terminate=True)
    wait_until(lambda: held("redis", f"sleep:{name}") is None)
    assert time.monotonic() - started < 2.5  # released, not left to its 3 s lease
    with pytest.raises(TaskRevokedError):
        result.get(timeout=30)


@pytest.mark.parametrize(("task", "alias"), [(sleeper_on_mariadb, "mariadb"), (sleeper_on_zookeeper, "zookeeper")])
def test_the_holder_shows_its_task_id_on_other_backends(pair, log, name, task, alias):
    result = task.delay(name, log, 1.5)
    wait_until(lambda: held(alias, f"hold:{name}") is not None)
    assert held(alias, f"hold:{name}").owner.endswith(f" task {result.id}")
    result.get(timeout=30)
    assert held(alias, f"hold:{name}") is None


def test_released_on_the_soft_time_limit(pair, log, name):
    result = sleeper.apply_async((name, log, 30), soft_time_limit=1)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=30)
    assert held("redis", f"sleep:{name}") is None


def test_a_hard_time_limit_frees_it_after_its_ttl(pair, log, name):
    result = sleeper.apply_async((name, log, 30), time_limit=1)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30)
    wait_until(lambda: held("redis", f"sleep:{name}") is None, timeout=3 + 2)
    assert isinstance(sleeper.delay(name, log, 0).get(timeout=30), int)


def test_a_sigkilled_worker_frees_it_after_its_ttl(celery_workers, log, name):
    queue = f"q-{name}"
    [worker] = celery_workers(1, 2, "-Q", queue)
    sleeper.apply_async((name, log, 30), queue=queue)
    wait_until(lambda: held("redis", f"sleep:{name}") is not None)
    killed = time.monotonic()
    worker.kill()
    assert held("redis", f"sleep:{name}") is not None
    wait_until(lambda: held("redis", f"sleep:{name}") is None, timeout=3 + 2)
    assert time.monotonic() - killed > 1.0  # it ran out, nobody released it
    celery_workers(1, 2, "-Q", queue)
    assert isinstance(sleeper.apply_async((name, log, 0), queue=queue).get(timeout=30), int)


@pytest.mark.parametrize(("deduped", "alias"), [(deduped, "redis"), (deduped_on_mariadb, "mariadb")])
def test_dedupe_at_enqueue_returns_the_queued_tasks_result(celery_workers, log, name, deduped, alias):
    queue = f"q-{name}"  # no worker takes it until the test starts one

    def send(*args):
        return deduped.apply_async(args, queue=queue)

    first = send(name, log, 60.0)  # until the test has seen it running
    assert send(name, log, 0).id == first.id  # queued, no worker yet
    other = send(f"{name}-other", log, 0)
    assert other.id != first.id
    marker = locks[alias].make_key(f"dedupe:dedupe:{name}")
    assert held(alias, f"dedupe:dedupe:{name}").owner.endswith(f" task {first.id}")
    # Only that task's identity can release its marker.
    assert not locks[alias].release(marker, task_owner(other.id, shared=True))
    celery_workers(1, 2, "-Q", queue)
    wait_until(lambda: held(alias, f"dedupe:{name}") is not None, timeout=60)  # a worker starting on a loaded machine
    assert send(name, log, 0).id == first.id  # running
    finish_early(log)
    first.get(timeout=30)
    other.get(timeout=30)
    wait_until(lambda: held(alias, f"dedupe:dedupe:{name}") is None, timeout=3)  # released as it ended
    again = send(name, log, 0)
    assert again.id != first.id
    again.get(timeout=30)
    assert len(events(log)) == 6  # first, other, again: the duplicates never ran


def test_a_running_tasks_dedupe_marker_is_renewed_past_its_ttl(celery_workers, log, name):
    """The marker of a task that runs longer than its lock_ttl (5 s) stays: a send then still returns the running task."""
    queue = f"q-{name}"
    first = deduped.apply_async((name, log, 8.0), queue=queue)
    celery_workers(1, 2, "-Q", queue)
    wait_until(lambda: held("redis", f"dedupe:{name}") is not None)  # running
    past_the_lease = time.monotonic() + 6.5  # the marker's lease is 5 s
    while time.monotonic() < past_the_lease:
        assert held("redis", f"dedupe:dedupe:{name}") is not None, "the marker ran out while the task ran"
        time.sleep(0.1)
    assert held("redis", f"dedupe:{name}") is not None, "the task ended early"
    assert deduped.apply_async((name, log, 0), queue=queue).id == first.id  # before: a duplicate was queued
    first.get(timeout=30)
    assert len(events(log)) == 2  # the duplicate never ran


def one(item):
    return item


def with_default(item, page=3):
    return item


def any_kwargs(**kwargs):
    return kwargs


def make_task(run=one, **options):
    return app.task(base=LockedTask, name=f"t-{uuid.uuid4()}", lazy=False, shared=False, **options)(run)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "lock_name is required"),
        ({"lock_name": ""}, "lock_name is required"),
        ({"lock_name": 42}, "lock_name must be a str or a callable, not int"),
        (
            {"lock_name": "x:{nope}"},
            r"lock_name 'x:\{nope\}' refers to \{nope\}, which is not an argument of the task \(arguments: item\)",
        ),
        ({"lock_name": "x:{0}"}, "must name arguments"),
        ({"lock_name": "x:{item"}, "not a valid format string"),
        ({"lock_name": "x", "lock_busy": "later"}, "lock_busy must be one of 'wait', 'skip', 'retry', not 'later'"),
        ({"lock_name": "x", "lock_ttl": 0}, "lock_ttl must be a finite number of seconds greater than 0"),
        ({"lock_name": "x", "lock_wait": -1}, "lock_wait must be 0 or more seconds"),
        ({"lock_name": "x", "lock_retry_countdown": "soon"}, "lock_retry_countdown must be a number"),
        ({"lock_name": "x", "lock_using": None}, "lock_using must be the str alias"),
        ({"lock_name": "x", "lock_dedupe": "yes"}, "lock_dedupe must be True or False"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        make_task(**options)


def test_lock_names_from_the_bound_arguments():
    assert make_task(with_default, lock_name="x:{item}:{page}").lock_name_for(("a",), {}) == "x:a:3"
    assert make_task(any_kwargs, lock_name="x:{item}").lock_name_for((), {"item": "b"}) == "x:b"
    assert make_task(one, lock_name=lambda item: f"y:{item}").lock_name_for((), {"item": 1}) == "y:1"
    assert guarded.lock_name_for(("a", "log"), {}) == "guard:a"
    with pytest.raises(ValueError, match="cannot bind the arguments"):
        guarded.lock_name_for((), {})
    with pytest.raises(ValueError, match="cannot be formed from this call"):
        make_task(any_kwargs, lock_name="x:{item}").lock_name_for((), {})


def test_dedupe_and_across_retries_refuse_zookeeper():
    task = make_task(lock_name="x:{item}", lock_using="zookeeper", lock_dedupe=True)
    with pytest.raises(ImproperlyConfigured, match="need a lease backend"):
        task.delay("a")


def test_called_directly_it_just_runs(log, name):
    assert guarded(name, log, 0) == os.getpid()
    assert held("redis", f"guard:{name}") is None
    assert distlocks.lock(f"guard:{name}", using="redis").acquire(wait=0)


def test_the_demo_shops_restock_task_shares_the_buy_views_lock():
    from demo_shop.shop.tasks import restock

    assert restock.lock_using == "default"
    assert restock.lock_name_for(("p1", 5), {}) == "stock:p1"  # the name the lock:default view takes
    assert restock("p1", 5) == 5  # called directly: a plain function call
    assert restock("p1", 2) == 7
