"""Semaphore: at most ``permits`` holders at once across processes, each permit a lock of its own.

Permit ``i`` of semaphore ``exports`` is the ordinary lock ``sem:exports#i``:
its own lease renewed by the watchdog (a crashed holder's permit frees itself
after ``ttl``; on ZooKeeper with its session), its own fencing token, listed
and force-released like any lock. A caller first tries a few permits
(``FIRST_TRIES``), starting at a random one so that callers spread over them.
Callers that found them taken queue on the lock ``sem:exports#queue``, and
only the first in the queue tries every permit and waits for one: waiters are
served in the order the queue gives (Apache Curator's InterProcessSemaphoreV2 serializes its acquirers behind a
mutex in the same way). The number of permits is recorded on the server in
``sem:exports#permits`` by the first user (Redisson's semaphores keep it on
the server too): a user that passes another number gets ValueError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import re
import time

from django.utils.crypto import salted_hmac

from distlocks.backends.arguments import check_name_and_alias, check_wait
from distlocks.backends.base import deadline_after, time_left
from distlocks.exceptions import LockError, LockNotAcquired, LockNotOwned
from distlocks.handler import DEFAULT_ALIAS
from distlocks.lock import DistributedLock
from distlocks.lockapi import _DEFAULT, LockAPI
from distlocks.owner import Owner, acting_as, current_owner

logger = logging.getLogger(__name__)

#: Each permit is a lock of its own: beyond this many, a counter would serve better.
MAX_PERMITS = 1000
#: How many permits a caller tries before it queues (the first in the queue tries them all).
FIRST_TRIES = 3
#: The marker of the permits count outlives its last check by this long at least.
MARKER_LEASE = 600.0
_PERMITS = re.compile(r"permits=(\d+)$")
# (alias, name, permits) -> until when this process trusts its last look at the marker (monotonic).
_agreed: dict[tuple[str, str, int], float] = {}


def check_permits(permits: object) -> int:
    """Return ``permits``, or raise ValueError naming it."""
    if isinstance(permits, bool) or not isinstance(permits, int):
        raise ValueError(f"permits must be a positive int, not {type(permits).__name__}")
    if permits < 1:
        raise ValueError(f"permits must be a positive int, not {permits!r}")
    if permits > MAX_PERMITS:
        raise ValueError(f"permits must be at most {MAX_PERMITS} (each permit is a lock), not {permits!r}")
    return permits


class Semaphore(LockAPI):
    """At most ``permits`` holders of ``name`` at once, across processes.

    A thread holds at most one permit of a semaphore: acquiring again while it
    holds one counts one more hold of that permit (as the lock is reentrant).
    """

    noun = "Semaphore"
    async_form = "distlocks.asemaphore(...)"

    def __init__(
        self,
        name: str,
        permits: int,
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        check_name_and_alias(name, using)
        self.name = name
        self.permits = check_permits(permits)
        self.alias = using
        self.wait = check_wait(wait)
        self.slots = [
            DistributedLock(f"sem:{name}#{i}", using=using, ttl=ttl, wait=wait, renew=renew) for i in range(permits)
        ]
        self.queue = DistributedLock(f"sem:{name}#queue", using=using, ttl=ttl, renew=renew)
        self.marker = DistributedLock(f"sem:{name}#permits", using=using, renew=False)
        self.ttl = self.slots[0].ttl

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} permits={self.permits} using={self.alias!r} wait={self.wait}>"

    def _not_acquired(self, wait: float | None) -> LockNotAcquired:
        return self._error(LockNotAcquired, f"gave no permit within {wait}s")

    def _permit(self) -> DistributedLock | None:
        return next((slot for slot in self.slots if slot.hold_count), None)

    def _own_permit(self) -> DistributedLock:
        """The calling thread's permit; raise LockNotOwned if it holds none."""
        permit = self._permit()
        if permit is None:
            raise self._error(LockNotOwned, "gave no permit to this thread")
        return permit

    @property
    def slot(self) -> int:
        """Which permit the calling thread holds (0 to permits - 1); raise LockNotOwned if none."""
        return self.slots.index(self._own_permit())

    @property
    def token(self) -> int:
        """The fencing token of the calling thread's permit; raise LockNotOwned if it holds none."""
        return self._own_permit().token

    @property
    def hold_count(self) -> int:
        """How many times the calling thread holds its permit (0: none)."""
        permit = self._permit()
        return permit.hold_count if permit else 0

    @property
    def lost(self) -> bool:
        """True if the calling thread's permit was lost (expired, force-released)."""
        permit = self._permit()
        return bool(permit and permit.lost)

    def _owner(self) -> Owner:
        """The calling thread, labelled with the permits count it uses (shown by the admin and the commands)."""
        owner = current_owner()
        return owner if owner.task else dataclasses.replace(owner, task=f"permits={self.permits}")

    def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Take a permit, waiting at most ``wait`` seconds; return True if one was taken.

        Raise ValueError if the semaphore is in use with another number of
        permits, LockLost if the thread's permit was lost, BackendUnavailable if
        the server cannot be reached.
        """
        self._refuse_in_event_loop()
        wait = self.wait if wait is _DEFAULT else check_wait(wait)
        deadline = deadline_after(wait)
        order = self._try_first(wait)
        if isinstance(order, bool):
            return order
        with acting_as(self._owner()):
            if not self.queue.acquire(wait=time_left(deadline)):
                return False
            try:
                attempt = 0
                while True:
                    step = self._next_wait(order, attempt, deadline)
                    if isinstance(step, bool):
                        return step
                    if step[0].acquire(wait=step[1]):
                        return True
                    attempt += 1
            finally:
                self._leave_queue()

    def _try_first(self, wait: float | None) -> bool | list[DistributedLock]:
        """The steps of ``acquire`` that never wait: True or False once decided, else the permits to wait for, in order."""
        permit = self._permit()
        if permit is not None:
            return permit.acquire(wait=0)  # re-entry: never waits
        self._agree()
        start = random.randrange(self.permits)
        order = self.slots[start:] + self.slots[:start]
        with acting_as(self._owner()):
            if self._try_each(order[:FIRST_TRIES]):
                return True
            if wait == 0:
                return self._try_each(order[FIRST_TRIES:])
            self._check_holders(order)
        return order

    def _next_wait(
        self, order: list[DistributedLock], attempt: int, deadline: float | None
    ) -> bool | tuple[DistributedLock, float]:
        """First in the queue, try each permit: True if one is taken, False if time is up, else (the permit to wait on, how long).

        Each round waits on the next permit in turn, a little longer each round.
        """
        if self._try_each(order):
            return True
        left = time_left(deadline)
        if left == 0:
            return False
        spell = 0.05 * 2 ** min(attempt, 3)
        return order[attempt % self.permits], spell if left is None else min(spell, left)

    def _leave_queue(self) -> None:
        # The permit is what the caller asked for: a queue lock that cannot be
        # released runs out by itself.
        try:
            self.queue.release()
        except LockError as exc:
            logger.warning("%s", self._message(f"could not release its queue lock: {exc}"))

    @staticmethod
    def _try_each(order: list[DistributedLock]) -> bool:
        return any(slot.acquire(wait=0) for slot in order)

    def _agree(self) -> None:
        """Make sure every user of the name passes the same ``permits``: raise ValueError if not.

        The first user records the count on the server in ``sem:<name>#permits``
        and each process looks at it again once a ``ttl``. On a lease backend it
        is a lease held by an owner that every user of the same count shares
        (its secret is derived from the count and SECRET_KEY), so that they all
        renew it and a user of another count cannot. On ZooKeeper, whose holds
        live with one session, it is the data of a persistent node.
        """
        agreed = (self.alias, self.name, self.permits)
        if _agreed.get(agreed, 0.0) > time.monotonic():
            return
        if self.marker.session_bound:
            # The native database locks keep no such value: there only the holders' owners tell.
            with contextlib.suppress(NotImplementedError):
                self._compare(self.marker.record(f"permits={self.permits}"))
            _agreed[agreed] = time.monotonic() + self.ttl
            return
        secret = salted_hmac("distlocks.semaphore", "\0".join(map(str, agreed)), algorithm="sha256").hexdigest()
        owner = dataclasses.replace(current_owner(), secret=secret[:32], task=f"permits={self.permits}")
        lease = max(MARKER_LEASE, 10 * self.ttl)
        for _ in range(3):
            with acting_as(owner):
                # Taken, or held by this count's owner already (another process's, or ours a ttl ago): renewed.
                kept = self.marker.take_detached(lease) is not None or self.marker.extend_detached(lease)
            if kept:
                _agreed[agreed] = time.monotonic() + self.ttl
                return
            holder = self.marker.holder()
            self._compare(holder.owner if holder else "")
        # Held for the same count by an owner we cannot be: another SECRET_KEY.
        logger.warning("%s", self._message("has a permits marker of another SECRET_KEY: counts not compared"))

    def _check_holders(self, order: list[DistributedLock]) -> None:
        """Every permit is taken: compare our count with the one a holder was given."""
        holder = order[0].holder()
        self._compare(holder.owner if holder else "")

    def _compare(self, recorded: str) -> None:
        """Raise ValueError if ``recorded`` (an owner's label, a marker) names another count of permits."""
        found = _PERMITS.search(recorded)
        if found and int(found.group(1)) != self.permits:
            raise ValueError(
                f"permits is {self.permits}, but semaphore {self.name!r} on {self.alias!r} "
                f"is in use with permits={found.group(1)}: every user of one name must pass the same permits"
            )

    def release(self) -> None:
        """Release one hold of the calling thread's permit.

        Raise LockNotOwned if it holds none, LockLost if its permit was lost
        (expired, force-released) while held.
        """
        self._own_permit().release()


def semaphore(
    name: str,
    permits: int,
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = None,
    renew: bool = True,
) -> Semaphore:
    """Return a semaphore of ``permits`` on ``name`` from the ``using`` backend (see Semaphore)."""
    return Semaphore(name, permits, using=using, ttl=ttl, wait=wait, renew=renew)
