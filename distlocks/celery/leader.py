"""What the schedulers of one Celery beat at a time share (``distlocks.celery.beat``): campaign, takeover, claims."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from celery import beat
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, close_old_connections, router, transaction
from django.utils import timezone

from distlocks.election import Election, Term
from distlocks.exceptions import LockError
from distlocks.handler import DEFAULT_ALIAS

logger = logging.getLogger(__name__)

#: The message headers of a dispatched run: its due time (ISO 8601) and the leader's term.
DUE_HEADER = "distlocks_beat_due"
TERM_HEADER = "distlocks_beat_term"
#: How long a standby's tick waits to be elected before it lets beat's loop go round.
STANDBY_LOOK = 1.0
#: How often the leader's campaign thread asks whether its term is still held.
TERM_LOOK = 0.1
SETTING_NAMES = ("USING", "TTL", "NAME")


def beat_settings(app_name: str | None) -> tuple[str, str, float | None]:
    """(election name, lock alias, ttl) from ``DISTLOCKS_BEAT``; ImproperlyConfigured for a misspelt key."""
    conf = getattr(settings, "DISTLOCKS_BEAT", None) or {}
    if not isinstance(conf, dict):
        raise ImproperlyConfigured(f"DISTLOCKS_BEAT must be a dict, not {type(conf).__name__}")
    unknown = sorted(set(conf) - set(SETTING_NAMES))
    if unknown:
        raise ImproperlyConfigured(f"DISTLOCKS_BEAT has unknown keys {unknown}: it takes {list(SETTING_NAMES)}")
    name = conf.get("NAME") or f"celery.beat:{app_name or 'celery'}"
    return name, conf.get("USING", DEFAULT_ALIAS), conf.get("TTL")


def due_time(entry: beat.ScheduleEntry) -> datetime:
    """When ``entry``'s next run is due after its ``last_run_at``: the same moment whoever asks, and whenever.

    The schedule is asked with its clock stopped at one moment, so that
    ``now + remaining`` is its due time exactly, not a moment that moves with
    the caller's clock.
    """
    now = datetime.now(dt_timezone.utc)
    frozen = copy.copy(entry.schedule)
    frozen.nowfun = lambda: now
    last_run_at = entry.last_run_at or now
    return now + frozen.remaining_estimate(frozen.maybe_make_aware(last_run_at))


def _db_time(moment: datetime) -> datetime:
    """``moment`` as the database stores it (naive in the current time zone without USE_TZ)."""
    return moment if settings.USE_TZ else timezone.make_naive(moment)


def _from_db(moment: datetime) -> datetime:
    """A datetime read from the database, aware (naive ones are in the current time zone: no USE_TZ)."""
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


def _aware(moment: datetime) -> datetime:
    """A datetime of Celery's, aware (Celery takes a naive one for UTC)."""
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment, dt_timezone.utc)


def fence_records(schedule: str, entries: list[str], token: int) -> None:
    """Make the dispatch records of ``entries`` and fence all of ``schedule``'s with ``token``.

    Raise StaleToken if a newer term fenced or claimed any of them: then no
    claim of this term's can succeed.
    """
    from distlocks.fencing import fenced_update
    from distlocks.models import BeatDispatch

    records = BeatDispatch._default_manager.filter(schedule=schedule)
    known = set(records.values_list("entry", flat=True))
    for name in entries:
        if name not in known:
            with contextlib.suppress(IntegrityError), transaction.atomic(using=router.db_for_write(BeatDispatch)):
                BeatDispatch._default_manager.create(
                    schedule=schedule, entry=name, fence_token=token
                )  # or made by another beat
    fenced_update(records, token)


def claim(schedule: str, entry: str, due: datetime, ran_at: datetime, token: int) -> bool | None:
    """Claim the run of ``entry`` due at ``due`` (sent at ``ran_at``) for the term ``token``; True if this call won it.

    One fenced ``UPDATE``: it moves the record's due time forward only if no
    newer term wrote the record and no run due at or after ``due`` was claimed
    already, so the check and the claim cannot race. None if the entry has no
    record (added since the term began: ``fence_records`` makes it).
    """
    from django.db.models import Q

    from distlocks.models import BeatDispatch

    record = BeatDispatch._default_manager.filter(schedule=schedule, entry=entry)
    claimed = record.filter(Q(due_at__lt=_db_time(due)) | Q(due_at=None), fence_token__lte=token).update(
        due_at=_db_time(due), ran_at=_db_time(_aware(ran_at)), fence_token=token
    )
    if claimed:
        return True
    return False if record.exists() else None


def last_runs(schedule: str) -> dict[str, datetime]:
    """When each entry of ``schedule`` was last sent, as its dispatch record says."""
    from distlocks.models import BeatDispatch

    records = BeatDispatch._default_manager.filter(schedule=schedule).exclude(ran_at=None)
    return {name: _from_db(ran_at) for name, ran_at in records.values_list("entry", "ran_at")}


class LeaderScheduler:
    """What both schedulers add to their Celery scheduler: the campaign, the takeover and the claims.

    Mixed in before the scheduler class it extends (``beat.Scheduler`` or a subclass).
    """

    app: Any
    schedule: dict[str, beat.ScheduleEntry]
    _heap: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._term: Term | None = None
        self._elected = threading.Event()
        self._stopping = threading.Event()
        self._campaigner: threading.Thread | None = None
        self._ready_for: int | None = None  # the term whose schedule state was read
        self._reserved: dict[str, datetime] = {}
        name, using, ttl = beat_settings(kwargs["app"].main if "app" in kwargs else args[0].main)
        self.election = Election(name, using=using, ttl=ttl)
        super().__init__(*args, **kwargs)

    # -- the campaign, in a thread of its own --------------------------------------

    def _campaign(self) -> None:
        def on_elected(term: Term) -> None:
            self._term = term
            self._elected.set()
            logger.warning("beat: elected to dispatch %r (term %d)", self.election.name, term.token)
            while not term.lost and not self._stopping.wait(TERM_LOOK):
                pass

        def on_lost(term: Term) -> None:
            self._elected.clear()
            self._term = None
            logger.warning("beat: lost the lead of %r (term %d): standing by", self.election.name, term.token)

        while not self._stopping.is_set():
            try:
                self.election.run(on_elected, on_lost)
            except Exception:  # resigning failed (the lease runs out by itself), or worse: campaign on
                logger.exception("beat: the campaign for %r failed; campaigning again", self.election.name)
                self._stopping.wait(STANDBY_LOOK)
            self._elected.clear()
            self._term = None

    def _leading(self) -> Term | None:
        """The term if this beat leads now, else None (starting the campaign at the first call)."""
        if self._campaigner is None:
            self._campaigner = threading.Thread(target=self._campaign, name="distlocks-beat-campaign", daemon=True)
            self._campaigner.start()
        term = self._term
        return None if term is None or term.lost else term

    # -- the ticks -----------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        term = self._leading()
        if term is None:
            self._ready_for = None
            if self._elected.is_set():
                return TERM_LOOK  # a term just lost: the campaign thread is about to say so
            self._elected.wait(STANDBY_LOOK)
            return 0
        if self._ready_for != term.token:
            if not self._take_over(term):
                return STANDBY_LOOK
            self._ready_for = term.token
        return super().tick(*args, **kwargs)  # type: ignore[misc]

    def _reread(self) -> None:
        """Read the schedule again from where it is kept, before a new term's first tick."""

    def _take_over(self, term: Term) -> bool:
        """Fence the schedule's dispatch records with ``term``'s token and take each entry's last run from them.

        False if a newer term fenced them already (this one is over), or the database failed.
        """
        try:
            close_old_connections()
            self._reread()
            fence_records(self.election.name, list(self.schedule), term.token)
            self._runs_from(self.schedule)
        except LockError as exc:  # StaleToken: a newer term wrote
            logger.warning("beat: term %d of %r is over: %s", term.token, self.election.name, exc)
            return False
        except Exception:
            logger.exception("beat: could not read the dispatches of %r; trying again", self.election.name)
            return False
        self._heap = None  # Scheduler.tick rebuilds it from the entries
        logger.warning("beat: leading %r from term %d", self.election.name, term.token)
        return True

    def _runs_from(self, schedule: dict[str, beat.ScheduleEntry]) -> None:
        """Give each entry of ``schedule`` the last run its dispatch record has, if later than the entry's own."""
        for name, ran_at in last_runs(self.election.name).items():
            entry = schedule.get(name)
            if entry is not None and (entry.last_run_at is None or ran_at > _aware(entry.last_run_at)):
                self._set_last_run(entry, ran_at)

    def _set_last_run(self, entry: beat.ScheduleEntry, ran_at: datetime) -> None:
        entry.last_run_at = ran_at

    def reserve(self, entry: beat.ScheduleEntry) -> beat.ScheduleEntry:
        new_entry: beat.ScheduleEntry = super().reserve(entry)  # type: ignore[misc]
        self._reserved[entry.name] = new_entry.last_run_at
        return new_entry

    def apply_entry(self, entry: beat.ScheduleEntry, producer: Any = None) -> None:
        """Claim this due time of ``entry`` with the term's token, then send it; skip it if the claim is refused."""
        ran_at = self._reserved.pop(entry.name, None) or entry.default_now()
        term = self._leading()
        due = due_time(entry)
        if term is None or not self._claim(entry.name, due, ran_at, term):
            logger.warning(
                "beat: not sending %s due at %s: claimed by another term, or this one is over", entry.name, due
            )
            self._ready_for = None  # read the state again before the next dispatch
            return
        options = entry.options
        headers = {**options.get("headers", {}), DUE_HEADER: due.isoformat(), TERM_HEADER: term.token}
        entry.options = {**options, "headers": headers}  # this run's only
        try:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        finally:
            entry.options = options

    def _claim(self, name: str, due: datetime, ran_at: datetime, term: Term) -> bool:
        try:
            claimed = claim(self.election.name, name, due, ran_at, term.token)
        except Exception:
            logger.exception("beat: could not claim %s due at %s", name, due)
            return False
        if claimed is None:
            self._ready_for = None  # an entry added since the takeover: its record is made at the next one
        return bool(claimed)

    def close(self) -> None:
        """Write the state, then resign (a standby is elected at once) and stop campaigning."""
        try:
            super().close()  # type: ignore[misc]
        finally:
            self._stopping.set()
            if self._campaigner is not None and self._term is not None:
                self._campaigner.join(5)  # its run() returns, resigning

    @property
    def info(self) -> str:
        base: str = super().info  # type: ignore[misc]
        return f"{base}\n    . leader election -> {self.election.name!r} on {self.election.alias!r}".lstrip("\n")
