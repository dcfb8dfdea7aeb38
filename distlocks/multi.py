"""MultiLock: several locks taken all or none, in one order whatever order they were named in.

Two callers that lock overlapping sets never deadlock: both take the members
in sorted order, so the one that holds the first shared member gets the rest.
Each member is an ordinary ``DistributedLock`` (renewed, fenced, reentrant per
thread, listed and force-released like any lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from distlocks.backends.arguments import check_encodable, check_wait
from distlocks.backends.base import deadline_after, time_left
from distlocks.exceptions import LockLost, LockNotOwned
from distlocks.handler import DEFAULT_ALIAS
from distlocks.lock import DistributedLock
from distlocks.lockapi import _DEFAULT, E, LockAPI
from distlocks.owner import acting_as, current_owner


def check_names(names: Any) -> tuple[str, ...]:
    """Return the distinct names in sorted order, or raise ValueError naming ``names``."""
    if not isinstance(names, list | tuple):
        raise ValueError(f"names must be a list or tuple of lock names, not {type(names).__name__}")
    if not names:
        raise ValueError("names must name at least one lock")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"names must hold non-empty str lock names, not {name!r}")
        check_encodable(name, "names")
    return tuple(sorted(set(names)))


class MultiLock(LockAPI):
    """Several named locks on one backend, held all together or not at all.

    Duplicates in ``names`` are merged (a set of locks). ``wait`` is one deadline
    for the whole set. Ownership belongs to the calling thread, as for the lock.
    """

    async_form = "distlocks.amulti_lock(...)"

    def __init__(
        self,
        names: list[str] | tuple[str, ...],
        *,
        using: str = DEFAULT_ALIAS,
        ttl: float | None = None,
        wait: float | None = None,
        renew: bool = True,
    ) -> None:
        self.names = check_names(names)
        self.alias = using
        self.locks = [DistributedLock(name, using=using, ttl=ttl, wait=wait, renew=renew) for name in self.names]
        self.wait = check_wait(wait)

    def __repr__(self) -> str:
        return f"<MultiLock {list(self.names)!r} using={self.alias!r} wait={self.wait}>"

    def _message(self, what: str) -> str:
        return f"Locks {list(self.names)!r} on {self.alias!r} {what}"

    def _error(self, kind: type[E], what: str) -> E:
        return kind(self._message(what), name=self.names[0], alias=self.alias)

    @property
    def tokens(self) -> dict[str, int]:
        """Each member's fencing token, by name: fence each resource with its own name's token."""
        self._check_held()
        return {lk.name: lk.token for lk in self.locks}

    @property
    def token(self) -> tuple[int, ...]:
        """The members' fencing tokens in ``names`` order (sorted); raise LockNotOwned if not held."""
        return tuple(self.tokens.values())

    @property
    def hold_count(self) -> int:
        """How many times the calling thread holds the whole set (0: not held)."""
        return min(lk.hold_count for lk in self.locks)

    @property
    def lost(self) -> bool:
        """True if the calling thread holds the set and any member's lease was lost."""
        return any(lk.lost for lk in self.locks)

    def _check_held(self) -> None:
        if not self.hold_count:
            raise self._error(LockNotOwned, "are not held by this thread")

    def acquire(self, wait: float | None = _DEFAULT) -> bool:
        """Take every member, in sorted order, within ``wait`` seconds in all; return True if all were taken.

        If one is not taken in time, those taken are released again and False
        is returned: nothing is left held. Raise what a member's acquire raises
        (LockLost, BackendUnavailable), after releasing the members taken.
        """
        self._refuse_in_event_loop()
        wait = self.wait if wait is _DEFAULT else check_wait(wait)
        deadline = deadline_after(wait)
        taken: list[DistributedLock] = []
        owner = current_owner()
        if not owner.task:  # shown by the admin and the commands: these locks are taken together
            owner = dataclasses.replace(owner, task=f"multi={len(self.locks)}")
        try:
            with acting_as(owner):
                self._take_all(taken, deadline)
        except BaseException:
            with contextlib.suppress(Exception):
                self._release_all(taken)
            raise
        if len(taken) < len(self.locks):
            self._release_all(taken)
            return False
        return True

    def _take_all(self, taken: list[DistributedLock], deadline: float | None) -> None:
        """Take the members in order until one is not taken in time, appending each to ``taken``."""
        for lk in self.locks:
            if not lk.acquire(wait=time_left(deadline)):
                return
            taken.append(lk)

    def release(self) -> None:
        """Release one hold of every member, the last taken first.

        Raise LockNotOwned if the calling thread does not hold the set, and
        LockLost (once every member has been released) if any member was lost.
        """
        self._check_held()
        self._release_all(self.locks)

    def _release_all(self, members: list[DistributedLock]) -> None:
        lost: LockLost | None = None
        error: Exception | None = None
        for lk in reversed(members):
            try:
                lk.release()
            except LockLost as exc:
                lost = lost or exc
            except Exception as exc:  # the other members must still be released
                error = error or exc
        if lost is not None:
            raise self._error(LockLost, f"were lost while held: {lost}")
        if error is not None:
            raise error


def multi_lock(
    names: list[str] | tuple[str, ...],
    *,
    using: str = DEFAULT_ALIAS,
    ttl: float | None = None,
    wait: float | None = None,
    renew: bool = True,
) -> MultiLock:
    """Return a lock on all of ``names`` together, on the ``using`` backend (see MultiLock)."""
    return MultiLock(names, using=using, ttl=ttl, wait=wait, renew=renew)
