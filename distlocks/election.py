"""Leader election: one leader per name across processes, each term a lease of the lock ``leader:<name>``.

A term is an ordinary hold of that lock: the watchdog renews its lease and
tells ``lock_lost`` when it cannot, and its fencing token is the term's, larger
than every earlier term's. On top of that a leader asks, before it acts,
whether the lease is still proven by its own clock (``Term.lost``): a process
paused past its lease (SIGSTOP, a GC pause, a VM migration) finds its term over
when it resumes, before its watchdog thread has had a chance to run. Curator's
LeaderLatch and client-go's leaderelection tell a leader it lost but give no
token; etcd's election fences with the lease's revision, as this does with the token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from distlocks.backends.arguments import check_name_and_alias, check_wait
from distlocks.backends.base import LockInfo
from distlocks.exceptions import BackendUnavailable, LeadershipLost, LockError, LockLost, LockNotAcquired
from distlocks.handler import DEFAULT_ALIAS
from distlocks.holds import Hold
from distlocks.lock import DistributedLock
from distlocks.watchdog import watchdog

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: The lock an election is held as: ``distlocks_list`` and the admin show it as kind "leader".
PREFIX = "leader:"
#: How long ``run()`` waits before campaigning again after the backend could not be reached.
RETRY_INTERVAL = 1.0


class Term:
    """One process's leadership, from its election to its resignation or loss."""

    def __init__(self, election: Election, hold: Hold) -> None:
        self.election = election
        self._hold = hold
        self._over = False
        #: Whether the term was found lost when it ended (None: not ended).
        self.ended_lost: bool | None = None
        #: When it began (``time.monotonic()``).
        self.since = hold.acquired

    def __repr__(self) -> str:
        return f"<Term {self.token} of {self.election.name!r} on {self.election.alias!r}>"

    @property
    def token(self) -> int:
        """The term's fencing token: larger than every earlier term's of this election."""
        return self._hold.token

    @property
    def lost(self) -> bool:
        """True once leadership may be gone: the lease was lost or is no longer proven, or the term ended.

        It asks no server: it compares the hold's proven lease with the clock,
        so it is cheap enough to ask before every action.
        """
        hold = self._hold
        if self._over or hold.lost:
            return True
        if time.monotonic() < hold.backend.proven_until(hold.key, hold.owner, hold.lease_ends):
            return False
        # Told here first when the watchdog's thread has not run yet (the process was paused).
        watchdog().lose(hold, "its lease ended before a renewal could be proven", watched_only=False)
        return True

    def _end(self) -> None:
        self.ended_lost = self.lost
        self._over = True

    def check(self) -> None:
        """Raise LeadershipLost if the term is over (see ``lost``); return at once otherwise."""
        if self.lost:
            raise self.election._lost(self.token)


class Election:
    """One leader at a time for ``name`` on the ``using`` backend, across processes and hosts.

    Leading is holding the lock ``leader:<name>`` (``ttl``: its lease, renewed
    while leading); a standby waits for it.
    """

    def __init__(self, name: str, *, using: str = DEFAULT_ALIAS, ttl: float | None = None) -> None:
        check_name_and_alias(name, using)
        self.name = name
        self.alias = using
        self._lock = DistributedLock(f"{PREFIX}{name}", using=using, ttl=ttl)
        self.ttl = self._lock.ttl

    def __repr__(self) -> str:
        return f"<Election {self.name!r} using={self.alias!r} ttl={self.ttl}>"

    def _message(self, what: str) -> str:
        return f"Leadership of {self.name!r} on {self.alias!r} {what}"

    def _lost(self, token: int) -> LeadershipLost:
        return LeadershipLost(self._message(f"was lost (term {token})"), name=self.name, alias=self.alias)

    @contextlib.contextmanager
    def lead(self, wait: float | None = None) -> Iterator[Term]:
        """Campaign until elected (at most ``wait`` seconds; None: forever), and lead while the block runs.

        Yield the ``Term``. Leaving the block resigns, so that a standby is
        elected at once; leaving it normally after the term was lost raises
        LeadershipLost. Raise LockNotAcquired if not elected within ``wait``,
        BackendUnavailable if the server cannot be reached, ValueError if the
        calling thread leads this election already.
        """
        wait = check_wait(wait)
        lock = self._lock
        if lock.hold_count:
            raise ValueError(self._message("is held by this thread already: a term cannot hold another"))
        if not lock.acquire(wait=wait):
            raise LockNotAcquired(self._message(f"not won within {wait}s"), name=self.name, alias=self.alias)
        hold = lock._hold()
        assert hold is not None
        term = Term(self, hold)
        logger.info("Elected leader of %r on %r", self.name, self.alias)
        try:
            yield term
        except BaseException:
            term._end()
            with contextlib.suppress(LockError):  # the block's own error says more
                lock.release()
            raise
        term._end()
        try:
            lock.release()
        except LockLost as exc:
            raise self._lost(term.token) from exc
        logger.info("Resigned as leader of %r on %r", self.name, self.alias)

    def leader(self) -> LockInfo | None:
        """The current leader (its ``token`` is its term's), or None; one look at the server."""
        info = self._lock.holder()
        return None if info is None else dataclasses.replace(info, kind="leader")

    def run(self, on_elected: Callable[[Term], R], on_lost: Callable[[Term], object] | None = None) -> R:
        """Campaign, and call ``on_elected(term)`` once elected; campaign again whenever leadership is lost.

        ``on_elected`` does the leader's work, asking ``term.lost`` (or
        ``term.check()``) before each action. When leadership is lost (it
        raised LockLost, such as ``check()``'s LeadershipLost or a fenced
        write's StaleToken, or it returned after the term was lost) this calls
        ``on_lost(term)`` and campaigns again: a loss never raises out of here.
        Neither does a backend that cannot be reached while campaigning: it is
        logged and tried again. When ``on_elected`` returns with the term
        still held, resign and return what it returned.
        """
        while True:
            term: Term | None = None
            try:
                with self.lead() as term:
                    result = on_elected(term)
                    term.check()
                return result
            except LockLost as exc:
                if term is None:
                    raise
                logger.warning("Leadership of %r on %r lost (term %d): %s", self.name, self.alias, term.token, exc)
            except BackendUnavailable as exc:
                if term is not None and not term.ended_lost:
                    raise  # on_elected's own, while it led
                logger.warning("Campaign for %r on %r: %s; trying again", self.name, self.alias, exc)
                time.sleep(RETRY_INTERVAL)
                if term is None:
                    continue
            if on_lost is not None:
                on_lost(term)


def election(name: str, *, using: str = DEFAULT_ALIAS, ttl: float | None = None) -> Election:
    """Return the election of a leader for ``name`` on the ``using`` backend (see Election)."""
    return Election(name, using=using, ttl=ttl)
