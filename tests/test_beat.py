"""One Celery beat at a time: real ``celery beat`` processes, a real worker on RabbitMQ, a task every second.

Each test starts a worker and two or three beats, SIGKILLs, SIGSTOPs (past the
lease, then SIGCONT) and cleanly stops the leader in turn, and reads what the
worker ran: each run's due time, the term that sent it and when it ran.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from celery.beat import ScheduleEntry
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

import distlocks
from distlocks.celery.leader import beat_settings, claim, due_time, fence_records, last_runs
from distlocks.exceptions import StaleToken
from distlocks.models import BeatDispatch

from .conftest import DB, ROOT, wait_until, worker_env

pytestmark = [DB, pytest.mark.timeout(180)]

TTL = 2  # DISTLOCKS_BEAT["TTL"] in tests/settings.py
# Beyond the interval of one second, how late a run may be on a loaded machine.
SLACK = 1.0


class CeleryProcess:
    """``celery -A tests.celery_beat_app ...`` in a process group of its own."""

    def __init__(self, env, stderr, *arguments):
        command = [sys.executable, "-m", "celery", "-A", "tests.celery_beat_app", *map(str, arguments)]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr
        )
        self.pid = self.process.pid

    def signal(self, number):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, number)

    def kill(self):
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.process.wait()


class Beats:
    """A worker and ``count`` beats of one schedule, and what the worker ran."""

    def __init__(self, tmp_path, scheduler, count, *, using, database, lock_alias):
        self.log = tmp_path / "runs"
        self.log.touch()
        self.name = f"beat-{uuid.uuid4().hex}"
        self.queue = f"distlocks-beat-{self.name}"
        self.lock_alias = lock_alias  # the election's alias as this process names it
        self.database = database  # the beats' default database as this process names it
        env = {
            **worker_env(),
            "CELERY_SKIP_CHECKS": "1",
            "DISTLOCKS_TEST_BEAT_LOG": str(self.log),
            "DISTLOCKS_TEST_BEAT_QUEUE": self.queue,
            "DISTLOCKS_TEST_BEAT_NAME": self.name,
            "DISTLOCKS_TEST_BEAT_USING": using,
            "DISTLOCKS_TEST_DEFAULT_DATABASE": database,
        }
        self.stderr = open(tmp_path / "stderr", "w")  # noqa: SIM115 - closed in stop()
        self.processes = []
        self.worker = self._start(env, "worker", "-P", "solo", "-Q", self.queue, "-n", f"{self.name}@tests",
                                  "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING")  # fmt: skip
        self.beats = [
            self._start(
                env,
                "beat",
                "-S",
                scheduler,
                "-s",
                tmp_path / f"schedule-{i}",
                "--pidfile",
                tmp_path / f"beat-{i}.pid",
                "-l",
                "INFO",
            )  # fmt: skip
            for i in range(count)
        ]

    def _start(self, env, *arguments):
        process = CeleryProcess(env, self.stderr, *arguments)
        self.processes.append(process)
        return process

    def runs(self):
        """(due time, term, when it ran) of each run, in the order they ran."""
        runs = []
        for line in self.log.read_text().splitlines():
            due, term, ran = line.split()
            runs.append((due, int(term), float(ran)))
        return runs

    def leader(self):
        """The beat process that leads now, or None."""
        info = distlocks.election(self.name, using=self.lock_alias).leader()
        pid = None if info is None else int(info.owner.split(":")[1])
        return next((beat for beat in self.beats if beat.pid == pid), None)

    def next_term(self, after, within):
        """Wait for a run sent by a term newer than ``after``; return (its term, seconds it took)."""
        started = time.monotonic()
        wait_until(lambda: any(term > after for _, term, _ in self.runs()), timeout=within)
        return max(term for _, term, _ in self.runs()), time.monotonic() - started

    def runs_of(self, term, count, within=15):
        wait_until(lambda: sum(1 for _, t, _ in self.runs() if t == term) >= count, timeout=within)

    def stop(self):
        for process in self.processes:
            process.kill()
        self.stderr.close()
        from tests.celery_beat_app import app

        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(self.queue)


@pytest.fixture
def beats(tmp_path):
    started = []

    def start(scheduler, count, **kwargs):
        started.append(Beats(tmp_path, scheduler, count, **kwargs))
        return started[-1]

    yield start
    for group in started:
        group.stop()


def check_runs(group, terms):
    """No due time ran twice; the terms sent in turn; within a term, each run due a second after the one before was sent."""
    runs = sorted(group.runs())
    dues = [due for due, _, _ in runs]
    assert len(dues) == len(set(dues)), "a due time ran twice"
    sent_by = [term for _, term, _ in runs]
    assert sent_by == sorted(sent_by), "an older term sent after a newer one"
    assert len(set(sent_by)) == terms
    for term in set(sent_by):
        # Each next run falls due a second after the one before was sent (it ran later than it was sent).
        mine = [(time_of(due), ran) for due, sent, ran in runs if sent == term]
        gaps = [due - ran for (_, ran), (due, _) in zip(mine, mine[1:], strict=False)]
        assert max(gaps, default=1) <= 1 + SLACK, f"term {term} skipped a run: gaps {gaps}"


def time_of(due):
    return datetime.fromisoformat(due).timestamp()


def kill(group, term):
    """SIGKILL the leader: a standby sends within the lease and a little more."""
    group.leader().kill()
    term, took = group.next_term(term, TTL + 3)
    return term


def pause(group, term):
    """SIGSTOP the leader past its lease: a standby sends; SIGCONT: the old leader sends nothing again."""
    paused = group.leader()
    paused.signal(signal.SIGSTOP)
    try:
        term, _ = group.next_term(term, TTL + 3)
    finally:
        paused.signal(signal.SIGCONT)
    group.runs_of(term, 3)  # the resumed beat had time to send, had it thought it led
    return term


def stop_cleanly(group, term):
    """SIGTERM the leader: it resigns, and a standby is elected at once."""
    leader = group.leader()
    leader.signal(signal.SIGTERM)
    stopped = time.monotonic()
    wait_until(lambda: group.leader() not in (None, leader), timeout=5)
    assert time.monotonic() - stopped < 2
    assert leader.process.wait(10) == 0
    term, _ = group.next_term(term, 5)
    return term


def test_database_scheduler_three_beats(beats):
    """django-celery-beat's schedule on PostgreSQL, the election on the database backend there."""
    group = beats(
        "distlocks.celery.beat:DatabaseScheduler", 3, using="default", database="postgresql", lock_alias="postgresql"
    )
    term, _ = group.next_term(0, 60)
    group.runs_of(term, 3)
    term = kill(group, term)
    group.runs_of(term, 3)
    term = pause(group, term)
    term = stop_cleanly(group, term)
    group.runs_of(term, 3)
    check_runs(group, terms=4)
    record = BeatDispatch.objects.using("postgresql").get(schedule=group.name, entry="tick")
    assert record.fence_token == term


@pytest.mark.servers("redis")
def test_persistent_scheduler_two_beats(beats):
    """Celery's file schedule (one file per beat), the election on Redis, the dispatch records on MariaDB."""
    group = beats("distlocks.celery.beat:PersistentScheduler", 2, using="redis", database="mariadb", lock_alias="redis")
    term, _ = group.next_term(0, 60)
    group.runs_of(term, 3)
    term = pause(group, term)
    term = stop_cleanly(group, term)
    group.runs_of(term, 3)
    check_runs(group, terms=3)


def test_a_due_time_is_claimed_once_and_never_by_an_older_term():
    """The claims of two beats that both believe they lead: the fence and the due time decide, one UPDATE each."""
    schedule = f"claims-{uuid.uuid4().hex}"
    start = datetime(2026, 1, 1, tzinfo=dt_timezone.utc)

    def at(seconds):
        return start + timedelta(seconds=seconds)

    assert claim(schedule, "tick", at(1), at(1), 5) is None  # no record: the takeover makes it
    fence_records(schedule, ["tick"], 5)
    assert claim(schedule, "tick", at(1), at(1.1), 5) is True
    assert claim(schedule, "tick", at(1), at(1.2), 5) is False  # the same due time again
    assert claim(schedule, "tick", at(0.5), at(1.3), 5) is False  # an earlier one
    fence_records(schedule, ["tick"], 7)  # a newer term took over
    assert claim(schedule, "tick", at(2), at(2), 5) is False  # the older term: refused, whatever the due time
    assert claim(schedule, "tick", at(2), at(2.1), 7) is True
    with pytest.raises(StaleToken):
        fence_records(schedule, ["tick"], 6)
    assert last_runs(schedule) == {"tick": at(2.1)}


def test_the_due_time_does_not_move_with_the_clock():
    every_second = ScheduleEntry(
        "tick", "t", last_run_at=datetime(2026, 1, 1, 12, tzinfo=dt_timezone.utc), schedule=1.0
    )
    every_minute = ScheduleEntry("tock", "t", last_run_at=datetime(2026, 1, 1, 12, 0, 30, tzinfo=dt_timezone.utc),
                                 schedule=crontab())  # fmt: skip
    assert due_time(every_second) == due_time(every_second) == datetime(2026, 1, 1, 12, 0, 1, tzinfo=dt_timezone.utc)
    assert due_time(every_minute) == datetime(2026, 1, 1, 12, 1, tzinfo=dt_timezone.utc)


def test_a_misspelt_setting_is_refused(settings):
    settings.DISTLOCKS_BEAT = {"USING": "default", "TLL": 5}
    with pytest.raises(ImproperlyConfigured, match=r"DISTLOCKS_BEAT has unknown keys \['TLL'\]"):
        beat_settings("tests")
    settings.DISTLOCKS_BEAT = {}
    assert beat_settings("tests") == ("celery.beat:tests", "default", None)
