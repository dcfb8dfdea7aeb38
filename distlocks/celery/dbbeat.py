"""``DatabaseScheduler``: django-celery-beat's schedule, dispatched by the elected beat only (see ``beat``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from distlocks.celery.leader import LeaderScheduler
from distlocks.election import Term

try:
    from django_celery_beat import schedulers
except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
    raise ImproperlyConfigured(
        "distlocks.celery.beat:DatabaseScheduler needs django-celery-beat: pip install 'distlocks[beat]'"
    ) from exc


class DatabaseScheduler(LeaderScheduler, schedulers.DatabaseScheduler):
    """django-celery-beat's periodic tasks (``PeriodicTask`` rows), dispatched by the elected beat only."""

    def _reread(self) -> None:
        self._dirty.clear()  # a previous term's state, older than the records
        self._initial_read = True  # the next look at ``schedule`` reads every entry again

    def _take_over(self, term: Term) -> bool:
        taken = super()._take_over(term)
        # Reading the entries may have marked the heap for a rebuild: it is rebuilt from them once, now.
        self._heap_invalidated = False
        return taken

    def all_as_schedule(self) -> dict[str, Any]:
        """The entries as the database has them; while leading, with the last runs of their dispatch records.

        ``PeriodicTask.last_run_at`` is written every few minutes only
        (``sync_every``): the records have each dispatch.
        """
        schedule: dict[str, Any] = super().all_as_schedule()
        if self._ready_for is not None:
            self._runs_from(schedule)
        return schedule

    def _set_last_run(self, entry: Any, ran_at: datetime) -> None:
        entry.last_run_at = entry.model.last_run_at = ran_at

    def sync(self) -> None:
        """Write the entries' state only while leading: a paused leader's is older than its successor's."""
        if self._term is not None and not self._term.lost:
            super().sync()
        else:
            self._dirty.clear()
