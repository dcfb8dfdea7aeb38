"""One background thread per process that renews the leases of held locks.

Redisson's watchdog: a held lock is renewed every ``ttl / 3``; a renewal that
finds the lease gone marks the hold lost and sends ``lock_lost``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from distlocks.backends.base import on_holds_in_doubt
from distlocks.signals import lock_lost

if TYPE_CHECKING:
    from distlocks.lock import Hold

logger = logging.getLogger(__name__)

# A renewal that failed with an error is retried this often, until the lease runs out.
RETRY_INTERVAL = 0.5


class Watchdog:
    """Renew the leases of the holds it watches, from a daemon thread."""

    def __init__(self) -> None:
        # Holds come and go at every acquire and release: they take the bare
        # lock (C-level); the condition on it wakes the thread.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._due: dict[Hold, float] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0

    def watch(self, hold: Hold) -> None:
        with self._lock:
            due = self._due[hold] = time.monotonic() + hold.ttl / 3
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="distlocks-watchdog", daemon=True)
                self._thread.start()
            if due < self._wake_at:
                self._cond.notify()  # only when it must wake earlier than planned: notifying costs a thread switch

    def renew_soon(self) -> None:
        """Renew every hold now: a backend learnt that some may be gone (a lost session)."""
        with self._cond:
            now = time.monotonic()
            for hold in self._due:
                self._due[hold] = now
            self._cond.notify()

    def unwatch(self, hold: Hold) -> None:
        with self._lock:
            self._due.pop(hold, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [hold for hold, at in self._due.items() if at <= now]
                if not due:
                    # Idle, it looks again every second, so that most new holds
                    # need no wake-up call.
                    self._wake_at = min(self._due.values(), default=now + 1.0)
                    self._cond.wait(self._wake_at - now)
                    self._wake_at = 0.0
                    continue
            for hold in due:
                self._renew(hold)

    def _renew(self, hold: Hold) -> None:
        from distlocks.handler import locks

        if not hold.thread.is_alive():
            # Its thread ended without releasing: let the lease run out rather
            # than keep a lock nobody can release for the life of the process.
            self.unwatch(hold)
            logger.warning(
                "Thread %s ended holding lock %r on %r; letting it expire", hold.thread.name, hold.name, hold.alias
            )
            return
        try:
            renewed = locks[hold.alias].extend(hold.key, hold.owner, hold.ttl)
        except Exception as exc:  # the watchdog must outlive any error
            if time.monotonic() < hold.lease_ends:
                logger.warning("Could not renew lock %r on %r, retrying: %s", hold.name, hold.alias, exc)
                with self._cond:
                    if hold in self._due:
                        self._due[hold] = time.monotonic() + min(RETRY_INTERVAL, hold.ttl / 10)
                return
            renewed = False
        if renewed:
            hold.lease_ends = time.monotonic() + hold.ttl
            with self._cond:
                if hold in self._due:
                    self._due[hold] = time.monotonic() + hold.ttl / 3
            return
        with self._cond:
            if self._due.pop(hold, None) is None:
                return  # released meanwhile: not lost
        hold.lost = True
        logger.warning("Lost lock %r on %r: its lease ended before renewal", hold.name, hold.alias)
        lock_lost.send(sender=hold.lock_class, name=hold.name, alias=hold.alias, token=hold.token)


_watchdog = Watchdog()


def watchdog() -> Watchdog:
    return _watchdog


def _reset_after_fork() -> None:
    # The child has none of the parent's threads, and must not renew its locks.
    global _watchdog
    _watchdog = Watchdog()


os.register_at_fork(after_in_child=_reset_after_fork)
on_holds_in_doubt(lambda alias: watchdog().renew_soon())
