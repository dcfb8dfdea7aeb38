"""The watchdog: it renews the leases of held locks and says when one is lost.

Redisson's watchdog: a held lock is renewed every ``ttl / 3``; a renewal that
finds the lease gone marks the hold lost and sends ``lock_lost``. Two kinds of
thread do the work, so that no fault in one place silences the others:

- one *renewer* thread per alias makes the requests, so a slow or hung server
  delays the renewals of its own alias only;
- one *timer* thread makes no request at all: it hands due holds to their
  renewer and marks a hold lost the moment its lease ends without a renewal
  it can prove, even while that renewal is still stuck in a request.

Both loops survive any exception, and a thread found dead is started again.
Signal receivers run through ``send_robust``: one that raises is logged.
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
# A hold whose lease has more than this share of its ttl left was renewed since it was queued.
FRESH = 0.75
# An idle timer looks again this often, so that most new holds need no wake-up call.
IDLE_LOOK = 1.0


def _forever(name: str, step: Callable[[], None]) -> Callable[[], None]:
    """Run ``step`` again and again, whatever it raises: a watchdog that dies renews nothing."""

    def loop() -> None:
        while True:
            try:
                step()
            except BaseException:  # noqa: B036 - a daemon thread: nothing above it would handle it
                logger.exception("distlocks %s: unexpected error, carrying on", name)
                time.sleep(0.01)  # no busy loop if the error repeats

    return loop


class _Renewer:
    """One alias's renewals, made one after another in a thread of their own."""

    def __init__(self, alias: str, watchdog: Watchdog) -> None:
        self.alias = alias
        self.watchdog = watchdog
        self.queue: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self.thread = _start(f"distlocks-renew-{alias}", self._next)

    def keep_alive(self) -> None:
        """Start the thread again if it died: the holds queued for it stay queued."""
        if not self.thread.is_alive():
            self.thread = _start(f"distlocks-renew-{self.alias}", self._next)

    def _next(self) -> None:
        hold = self.queue.get()
        if self.watchdog.watches(hold) and hold.lease_ends - time.monotonic() < hold.ttl * FRESH:
            self._renew(hold)  # else released, or renewed since it was queued again

    def _renew(self, hold: Hold) -> None:
        from distlocks.handler import locks

        if not hold.thread.is_alive():
            self.watchdog.unwatch(hold)
            _drop_orphaned(hold)
            return
        started = time.monotonic()
        try:
            renewed = locks[hold.alias].extend(hold.key, hold.owner, hold.ttl)
        except Exception as exc:
            logger.warning("Could not renew lock %r on %r, retrying: %s", hold.name, hold.alias, exc)
            self.watchdog.done(hold, retry_in=min(RETRY_INTERVAL, hold.ttl / 10))
            return
        if renewed:
            hold.renewed(started)
            self.watchdog.done(hold, retry_in=hold.ttl / 3)
        else:
            self.watchdog.lose(hold, "its lease was gone at renewal")


def _drop_orphaned(hold: Hold) -> None:
    """A thread ended without releasing: a lease runs out by itself, a session-bound hold is released."""
    logger.warning("Thread %s ended holding lock %r on %r", hold.thread.name, hold.name, hold.alias)
    if not hold.backend.session_bound:
        return  # nobody renews it any more: its lease runs out
    from distlocks.handler import locks

    backend = locks[hold.alias]
    try:
        for _ in range(hold.count + hold.uncounted):
            if not backend.release(hold.key, hold.owner):
                break
    except Exception as exc:
        logger.warning("Could not release lock %r on %r of an ended thread: %s", hold.name, hold.alias, exc)


def _start(name: str, step: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=_forever(name, step), name=name, daemon=True)
    thread.start()
    return thread


class Watchdog:
    """Renew the leases of the holds it watches; mark lost those it cannot renew in time."""

    def __init__(self) -> None:
        # Holds come and go at every acquire and release: they take the bare
        # lock (C-level); the condition on it wakes the timer.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._due: dict[Hold, float] = {}  # watched holds -> when to renew next
        self._renewers: dict[str, _Renewer] = {}
        self._timer: threading.Thread | None = None
        self._wake_at = 0.0

    def watch(self, hold: Hold) -> None:
        with self._lock:
            due = self._due[hold] = time.monotonic() + hold.ttl / 3
            if self._timer is None or not self._timer.is_alive():
                self._timer = _start("distlocks-watchdog", self._tick)
            if due < self._wake_at:
                self._cond.notify()  # only when it must wake earlier than planned: notifying costs a thread switch

    def unwatch(self, hold: Hold) -> None:
        with self._lock:
            self._due.pop(hold, None)

    def renew_soon(self, alias: str | None = None) -> None:
        """Renew the holds on ``alias`` (every alias: None) now: a backend said they may be gone."""
        with self._cond:
            now = time.monotonic()
            for hold in self._due:
                if alias is None or hold.alias == alias:
                    self._due[hold] = now
            self._cond.notify()

    def watches(self, hold: Hold) -> bool:
        return hold in self._due

    def done(self, hold: Hold, retry_in: float) -> None:
        """A renewer is done with ``hold``: renew it again in ``retry_in`` seconds."""
        with self._cond:
            if hold in self._due:
                self._due[hold] = time.monotonic() + retry_in
                self._cond.notify()

    def lose(self, hold: Hold, why: str) -> None:
        """Mark ``hold`` lost, unless it was released meanwhile, and send ``lock_lost``."""
        with self._lock:
            if self._due.pop(hold, None) is None:
                return  # released meanwhile: not lost
        hold.lost = True
        logger.warning("Lost lock %r on %r: %s", hold.name, hold.alias, why)
        # Receivers run in a thread of their own: one that blocks holds up nobody.
        threading.Thread(target=_tell_lost, args=(hold,), name="distlocks-lock-lost", daemon=True).start()

    def _tick(self) -> None:
        ended = []
        with self._cond:
            now = time.monotonic()
            wake_at = now + IDLE_LOOK
            for hold, due in self._due.items():
                if hold.lease_ends <= now:
                    ended.append(hold)
                    continue
                if due <= now:
                    # Queued again at this pace until a renewal comes back: a
                    # renewer that lost it (or is stuck) cannot leave it unrenewed.
                    due = self._due[hold] = now + min(RETRY_INTERVAL, hold.ttl / 10)
                    self._renewer(hold.alias).queue.put(hold)
                wake_at = min(wake_at, due, hold.lease_ends)
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


def _tell_lost(hold: Hold) -> None:
    lock_lost.send_robust(sender=hold.lock_class, name=hold.name, alias=hold.alias, token=hold.token)


_watchdog = Watchdog()


def watchdog() -> Watchdog:
    return _watchdog


def _reset_after_fork() -> None:
    # The child has none of the parent's threads, and must not renew its locks.
    global _watchdog
    _watchdog = Watchdog()


os.register_at_fork(after_in_child=_reset_after_fork)
on_holds_in_doubt(lambda alias: watchdog().renew_soon(alias))
