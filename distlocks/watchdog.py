"""The watchdog: it renews the leases of held locks and says when one is lost.

Redisson's watchdog: a held lock is renewed when a third of its lease has
passed; a renewal that finds the lease gone marks the hold lost and sends
``lock_lost``. Three kinds of thread do the work, so that no fault in one place
silences the others:

- one *renewer* per alias makes the requests, so a slow or hung server delays
  the renewals of its own alias only; a renewer stuck in one call for longer
  than the lease it is renewing is replaced by a new one (with a connection of
  its own), so that the alias's later locks are renewed again;
- the *timer* makes no request at all: it hands due holds to their renewer,
  marks a hold lost the moment its lease ends without a renewal it can prove
  (even while that renewal is still stuck in a request; not where ``ttl`` is
  no lease, on ZooKeeper: there the renewal, bounded in time, says when a hold
  is gone), and hands the holds of
  threads that ended to their renewer, to be released on session-bound backends;
- the *notifier* sends ``lock_lost``, with ``send_robust``, so that a receiver
  that raises is logged and one that blocks holds up no renewal.

Every loop survives any exception, and a thread found dead is started again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from distlocks.backends.base import on_holds_in_doubt
from distlocks.holds import Hold
from distlocks.signals import lock_lost

logger = logging.getLogger(__name__)

# A renewal that failed with an error is retried this often, until the lease runs out.
RETRY_INTERVAL = 0.5
# An idle timer looks again this often (for ended threads, and so that most new
# holds need no wake-up call).
IDLE_LOOK = 1.0


def _start(name: str, step: Callable[[], None], running: Callable[[], bool] = lambda: True) -> threading.Thread:
    """Start a daemon thread that runs ``step`` again and again while ``running()``, whatever it raises."""

    def loop() -> None:
        pause = 0.01
        while running():
            try:
                step()
                pause = 0.01
            except BaseException:  # noqa: B036 - a daemon thread: nothing above it would handle it
                logger.exception("distlocks %s: unexpected error, carrying on", name)
                time.sleep(pause)  # no busy loop if the error repeats
                pause = min(pause * 2, 1.0)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


class _Renewer:
    """One alias's requests (renewals, releases of ended threads' holds), one after another."""

    def __init__(self, alias: str, watchdog: Watchdog) -> None:
        self.alias = alias
        self.watchdog = watchdog
        self.queue: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self.current: Hold | None = None
        self.busy_since = 0.0
        self.retired = False
        self.thread = self._start()

    def _start(self) -> threading.Thread:
        return _start(f"distlocks-renew-{self.alias}", self._next, lambda: not self.retired)

    def keep_alive(self) -> None:
        """Start the thread again if it died: the holds queued for it stay queued."""
        if not self.thread.is_alive() and not self.retired:
            self.thread = self._start()

    def stuck(self, now: float) -> bool:
        """Whether the call in progress has lasted longer than the lease it is renewing."""
        current = self.current
        return current is not None and now - self.busy_since > current.ttl

    def _next(self) -> None:
        hold = self.queue.get()
        self.busy_since = time.monotonic()
        self.current = hold
        next_due = None
        try:
            if not hold.thread.is_alive():
                _drop(hold)
            elif self.watchdog.watches(hold):
                next_due = self._renew(hold)
        finally:
            self.current = None
            self.watchdog.settled(hold, self, next_due)

    def _renew(self, hold: Hold) -> float | None:
        """Renew ``hold``; return when to renew it next (None: lost)."""
        from distlocks.handler import locks

        started = time.monotonic()
        try:
            backend = hold.lock_class.primitives(locks[hold.alias])
            renewed = backend.extend_token(hold.key, hold.owner, hold.ttl, hold.token)
        except Exception as exc:
            logger.warning("Could not renew lock %r on %r, retrying: %s", hold.name, hold.alias, exc)
            return time.monotonic() + min(RETRY_INTERVAL, hold.ttl / 10)  # until the lease ends
        if not renewed:
            self.watchdog.lose(hold, "its lease was gone at renewal")
            return None
        hold.renewed(started)
        return hold.lease_ends - hold.ttl * 2 / 3


def _drop(hold: Hold) -> None:
    """Free the hold of a thread (or asyncio task) that ended without releasing it, if nothing else would."""
    what = "Thread" if isinstance(hold.thread, threading.Thread) else "Task"
    logger.warning("%s %s ended holding lock %r on %r", what, hold.thread.name, hold.name, hold.alias)
    if not hold.backend.session_bound:
        return  # nobody renews it any more: its lease runs out
    from distlocks.handler import locks

    try:
        hold.lock_class.primitives(locks[hold.alias]).drop(hold.key, hold.owner)  # the session outlives the thread
    except Exception as exc:
        logger.warning("Could not release lock %r on %r of an ended thread: %s", hold.name, hold.alias, exc)


class Watchdog:
    """Renew the leases of the holds it watches; mark lost those it cannot renew in time."""

    def __init__(self) -> None:
        # Holds come and go at every acquire and release: they take the bare
        # lock (C-level); the condition on it wakes the timer.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._due: dict[Hold, float] = {}  # renewed holds -> when to renew next
        self._kept: set[Hold] = set()  # holds not renewed, watched only for their thread's end
        self._renewing: dict[Hold, float] = {}  # queued for or in a renewer, since when
        self._renewers: dict[str, _Renewer] = {}
        self._timer: threading.Thread | None = None
        self._lost: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self._notifier: threading.Thread | None = None
        self._wake_at = 0.0

    def watch(self, hold: Hold, renew: bool = True) -> None:
        """Renew ``hold`` until ``unwatch()``; with ``renew=False`` only see to it if its thread ends."""
        with self._lock:
            if renew:
                due = self._due[hold] = hold.lease_ends - hold.ttl * 2 / 3
            else:
                self._kept.add(hold)
                due = time.monotonic() + IDLE_LOOK
            if self._timer is None or not self._timer.is_alive():
                self._timer = _start("distlocks-watchdog", self._tick)
            if due < self._wake_at:
                self._cond.notify()  # only when it must wake earlier than planned: notifying costs a thread switch

    def unwatch(self, hold: Hold) -> None:
        with self._lock:
            self._due.pop(hold, None)
            self._kept.discard(hold)

    def watches(self, hold: Hold) -> bool:
        return hold in self._due

    def renews(self, alias: str, key: str, token: int) -> bool:
        """Whether that acquisition of the lock is being renewed, by a live thread (``distlocks.testing`` waits for it)."""
        with self._lock:
            return any(
                (hold.alias, hold.key, hold.token) == (alias, key, token) and hold.thread.is_alive()
                for hold in self._due
            )

    def renew_soon(self, alias: str | None = None) -> None:
        """Renew the holds on ``alias`` (every alias: None) now: a backend said they may be gone."""
        with self._cond:
            now = time.monotonic()
            for hold in self._due:
                if alias is None or hold.alias == alias:
                    self._due[hold] = now
            self._cond.notify()

    def settled(self, hold: Hold, renewer: _Renewer, due: float | None) -> None:
        """``renewer`` is done with ``hold``, to be renewed again at ``due`` (None: not again)."""
        with self._cond:
            if self._renewers.get(hold.alias) is not renewer:
                return  # a renewer replaced while it was stuck: the new one looks after it
            self._renewing.pop(hold, None)
            if due is not None and hold in self._due:
                self._due[hold] = due
                self._cond.notify()

    def lose(self, hold: Hold, why: str, *, watched_only: bool = True) -> None:
        """Mark ``hold`` lost and have ``lock_lost`` sent, once.

        By default only a hold still watched: one released meanwhile was not
        lost. The holding thread, which finds a loss on its own, passes
        ``watched_only=False``.
        """
        with self._lock:
            watched = self._due.pop(hold, None) is not None
            if (watched_only and not watched) or hold.lost_told:
                return
            hold.lost = hold.lost_told = True
            if self._notifier is None or not self._notifier.is_alive():
                self._notifier = _start("distlocks-lock-lost", self._tell_lost)
        logger.warning("Lost lock %r on %r: %s", hold.name, hold.alias, why)
        self._lost.put(hold)

    def _tell_lost(self) -> None:
        hold = self._lost.get()
        lock_lost.send_robust(sender=hold.lock_class, name=hold.name, alias=hold.alias, token=hold.token)

    def _tick(self) -> None:
        ended, orphaned = [], []
        with self._cond:
            now = time.monotonic()
            wake_at = now + IDLE_LOOK
            for alias, renewer in list(self._renewers.items()):
                if renewer.stuck(now):
                    self._replace(alias, renewer)
                elif renewer.current is not None:
                    wake_at = min(wake_at, renewer.busy_since + renewer.current.ttl)
            for hold, due in self._due.items():
                if not hold.thread.is_alive():
                    orphaned.append(hold)
                elif hold.lease_ends <= now and hold.backend.ttl_is_lease:
                    ended.append(hold)
                else:
                    # Queued once; again only if its renewer lost it (an
                    # interrupted thread) a third of its lease ago.
                    queued = self._renewing.get(hold)
                    if queued is not None and now < queued + hold.ttl / 3:
                        due = queued + hold.ttl / 3
                    elif due <= now:
                        self._renewing[hold] = now
                        self._renewer(hold.alias).queue.put(hold)
                        due = now + hold.ttl / 3
                    wake_at = min(wake_at, due)
                if hold not in ended and hold.backend.ttl_is_lease:
                    wake_at = min(wake_at, hold.lease_ends)
            orphaned.extend(hold for hold in self._kept if not hold.thread.is_alive())
            for hold in orphaned:
                self._due.pop(hold, None)
                self._kept.discard(hold)
                self._renewer(hold.alias).queue.put(hold)  # it releases what must be released
            if not ended:
                self._wake_at = wake_at
                self._cond.wait(wake_at - now)
                self._wake_at = 0.0
        for hold in ended:
            self.lose(hold, "its lease ended before a renewal could be proven")

    def _renewer(self, alias: str) -> _Renewer:
        renewer = self._renewers.get(alias)
        if renewer is None:
            renewer = self._renewers[alias] = _Renewer(alias, self)
        renewer.keep_alive()
        return renewer

    def _replace(self, alias: str, stuck: _Renewer) -> None:
        """Leave a renewer stuck in a call to it, and give its alias a new one."""
        logger.warning("Renewals on %r stuck in one call for longer than a lease: renewing on a new connection", alias)
        stuck.retired = True
        self._renewers[alias] = _Renewer(alias, self)
        for hold in [hold for hold in self._renewing if hold.alias == alias]:
            del self._renewing[hold]


_watchdog = Watchdog()


def watchdog() -> Watchdog:
    return _watchdog


def _reset_after_fork() -> None:
    # The child has none of the parent's threads, and must not renew its locks.
    global _watchdog
    _watchdog = Watchdog()


os.register_at_fork(after_in_child=_reset_after_fork)
on_holds_in_doubt(lambda alias: watchdog().renew_soon(alias))
