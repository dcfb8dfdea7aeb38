"""One Celery beat at a time: schedulers that dispatch only while their process leads the election.

``CELERY_BEAT_SCHEDULER = "distlocks.celery.beat:PersistentScheduler"`` (over
Celery's own file schedule) or ``"distlocks.celery.beat:DatabaseScheduler"``
(over django-celery-beat's, ``pip install 'distlocks[beat]'``). Every beat
campaigns in a thread of its own; only the leader's ticks dispatch, the others
wait as standbys. A new leader first fences the schedule's dispatch records
(``BeatDispatch``) with its term's token and takes each entry's last run from
them, then ticks. Each dispatch is claimed before it is sent by one fenced
``UPDATE`` that moves the entry's ``due_at`` forward: a due time is sent at
most once, and a leader paused past its lease that resumes (or any beat whose
term a newer one replaced) has its claims refused.

Settings: ``DISTLOCKS_BEAT = {"USING": "default", "TTL": 30, "NAME": ...}``,
the lock alias the election runs on, its lease, and its name (by default
``celery.beat:<the Celery app's main name>``).
"""

from __future__ import annotations

from typing import Any

from celery import beat

from distlocks.celery.leader import LeaderScheduler


class PersistentScheduler(LeaderScheduler, beat.PersistentScheduler):
    """Celery's file schedule (``celerybeat-schedule``), dispatched by the elected beat only."""


def __getattr__(name: str) -> Any:
    """``DatabaseScheduler``, imported from django-celery-beat only when asked for."""
    if name == "DatabaseScheduler":
        from distlocks.celery.dbbeat import DatabaseScheduler

        return DatabaseScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
