"""In-process lock backend, for tests: the lock's semantics without a server.

Guarantees: inside one process, exactly what the other backends give. Threads
exclude each other; a lock is a lease of ``ttl`` seconds, renewed by the
watchdog, free once it runs out; every new acquisition of a name gets a larger
fencing token than the earlier ones (also after ``clear_expired``); a
force-release given a token frees only that acquisition. Waiters sleep on a
condition variable and are woken by a release or when the lease runs out, not
by polling (in no particular order).

Locks live in this process's memory: other processes never see them, so this
backend cannot lock across processes, hosts or a gunicorn's workers. The state
belongs to the store named by ``LOCATION`` (default: the alias); every alias
and thread with that name shares it. A forked child starts with no lock held
(its parent's holds are not its own, and the parent never learns of the
child's), and its tokens go on from the parent's.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from distlocks.backends.base import BaseLockBackend, LockInfo, deadline_after, holds_in_doubt
from distlocks.backends.sides import ReadWriteSide
from distlocks.owner import Owner


@dataclass
class _Held:
    secret: str
    owner: str
    token: int
    acquired_at: datetime
    expires: float  # time.monotonic()
    count: int = 1


@dataclass
class _ReadWrite:
    """A read-write lock: its writer, its readers and the writers waiting for it, by owner secret."""

    writer: _Held | None = None
    readers: dict[str, _Held] = field(default_factory=dict)
    waiting: dict[str, float] = field(default_factory=dict)  # secret -> until when (monotonic)

    def prune(self, now: float) -> None:
        """Forget expired holds and waiting records."""
        if self.writer is not None and self.writer.expires <= now:
            self.writer = None
        for secret in [secret for secret, held in self.readers.items() if held.expires <= now]:
            del self.readers[secret]
        for secret in [secret for secret, until in self.waiting.items() if until <= now]:
            del self.waiting[secret]

    def side(self, mode: str) -> dict[str, _Held]:
        """The holds of the ``mode`` side, by owner secret."""
        if mode == "read":
            return self.readers
        return {} if self.writer is None else {self.writer.secret: self.writer}


class _Store:
    """One named store: held locks, fencing counters and waiters, behind one mutex."""

    def __init__(self) -> None:
        self.locked = threading.Condition(threading.Lock())  # notified when a lock may have become free
        self.held: dict[str, _Held] = {}
        self.last_token: dict[str, int] = {}
        self.waiters: dict[str, int] = {}
        self.rw: dict[str, _ReadWrite] = {}

    def token(self, key: str) -> int:
        token = self.last_token[key] = self.last_token.get(key, 0) + 1
        return token

    def live(self, key: str, now: float) -> _Held | None:
        held = self.held.get(key)
        return held if held is not None and held.expires > now else None

    def mine(self, key: str, owner: Owner, now: float) -> _Held | None:
        held = self.live(key, now)
        return held if held is not None and held.secret == owner.secret else None

    def free(self, key: str) -> None:
        """Forget ``key``'s hold and wake its waiters (the caller holds the mutex)."""
        del self.held[key]
        self.locked.notify_all()


_stores: dict[str, _Store] = {}
_stores_lock = threading.Lock()


def store(name: str) -> _Store:
    """The store called ``name``, made on first use."""
    with _stores_lock:
        found = _stores.get(name)
        if found is None:
            found = _stores[name] = _Store()
        return found


def forget(name: str) -> None:
    """Drop the store called ``name``: its next user starts empty, with tokens from 1."""
    with _stores_lock:
        _stores.pop(name, None)


def _after_fork_in_child() -> None:
    """The child's threads are new owners and its parent's are gone: no hold and no waiter is the child's.

    Each store also gets a new mutex: a parent's thread may have held the old one at the fork.
    """
    global _stores_lock
    _stores_lock = threading.Lock()
    for name, old in list(_stores.items()):
        new = _stores[name] = _Store()
        new.last_token = dict(old.last_token)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _utc(now: float, moment: float) -> datetime:
    """A monotonic ``moment`` as a wall-clock time, for the admin."""
    return datetime.now(timezone.utc) + timedelta(seconds=moment - now)


class LocMemSide(ReadWriteSide):
    """A read-write lock's side in the store (see ``ReadWriteSide``): a ``_ReadWrite`` per read-write lock."""

    backend: LocMemBackend

    @staticmethod
    def _rw(store: _Store, key: str, now: float) -> _ReadWrite:
        rw = store.rw.get(key)
        if rw is None:
            rw = store.rw[key] = _ReadWrite()
        rw.prune(now)
        return rw

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        store = self.backend._store
        with store.locked:
            now = time.monotonic()
            rw = self._rw(store, self.lock_key(key), now)
            mine = rw.writer is not None and rw.writer.secret == owner.secret
            if self.mode == "read":
                free = mine or (rw.writer is None and not rw.waiting)
            else:
                free = rw.writer is None and not rw.readers
                if free and any(secret != owner.secret for secret in rw.waiting):
                    # Writers queue in the order they first waited (dicts keep it).
                    free = next(iter(rw.waiting)) == owner.secret
            if not free:
                if self.waits(key):
                    rw.waiting[owner.secret] = now + ttl
                    self.waiting(key, owner)
                return None
            token = store.token(self.lock_key(key))
            held = _Held(owner.secret, owner.description, token, datetime.now(timezone.utc), now + ttl)
            if self.mode == "read":
                rw.readers[owner.secret] = held
            else:
                rw.waiting.pop(owner.secret, None)
                rw.writer = held
            return held.token

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, more=1)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, more=0)

    def _renew(self, key: str, owner: Owner, ttl: float, more: int) -> bool:
        store = self.backend._store
        with store.locked:
            now = time.monotonic()
            held = self._rw(store, self.lock_key(key), now).side(self.mode).get(owner.secret)
            if held is None:
                return False
            held.count += more
            held.expires = now + ttl
            return True

    def release(self, key: str, owner: Owner) -> bool:
        store = self.backend._store
        with store.locked:
            rw = self._rw(store, self.lock_key(key), time.monotonic())
            held = rw.side(self.mode).get(owner.secret)
            if held is None:
                store.locked.notify_all()  # an expired lease was pruned: waiters may go
                return False
            held.count -= 1
            if held.count == 0:
                if self.mode == "read":
                    del rw.readers[owner.secret]
                else:
                    rw.writer = None
                store.locked.notify_all()
            return True

    def abandon(self, key: str, secret: str) -> None:
        store = self.backend._store
        with store.locked:
            rw = store.rw.get(self.lock_key(key))
            if rw is not None and rw.waiting.pop(secret, None) is not None:
                store.locked.notify_all()  # readers it blocked may go

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep until a release or a change of waiters, at most ``remaining`` seconds (or the next lease's end)."""
        store = self.backend._store
        with store.locked:
            rw = self._rw(store, self.lock_key(key), time.monotonic())
            ends = [held.expires for held in [*rw.side("write").values(), *rw.readers.values()]]
            ends.extend(rw.waiting.values())
            timeout = min(ends, default=time.monotonic()) - time.monotonic()
            timeout = max(0.001, timeout if remaining is None else min(timeout, remaining))
            store.locked.wait(min(timeout, 1.0))

    def force_release(self, key: str, token: int | None = None) -> bool:
        store = self.backend._store
        with store.locked:
            rw = store.rw.get(self.lock_key(key))
            if rw is None:
                return False
            rw.prune(time.monotonic())
            for mode in ("write", "read"):
                for secret, held in rw.side(mode).items():
                    if token is None or held.token == token:
                        if mode == "read":
                            del rw.readers[secret]
                        else:
                            rw.writer = None
                        store.locked.notify_all()
                        return True
            return False


class LocMemBackend(BaseLockBackend):
    """Locks in this process's memory, for tests (see the module's docstring)."""

    side_class = LocMemSide
    option_names = ()

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.store_name = self.location or alias

    @property
    def _store(self) -> _Store:
        return store(self.store_name)  # looked up each time: a fork or ``forget`` replaces it

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        store = self._store
        with store.locked:
            now = time.monotonic()
            if store.live(key, now) is not None:
                return None
            token = store.last_token[key] = store.last_token.get(key, 0) + 1
            store.held[key] = _Held(owner.secret, owner.description, token, datetime.now(timezone.utc), now + ttl)
            return token

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, more=1)

    def release(self, key: str, owner: Owner) -> bool:
        store = self._store
        with store.locked:
            held = store.held.get(key)
            if held is None or held.secret != owner.secret:
                return False
            if held.expires <= time.monotonic():
                store.free(key)  # our expired lease: gone, and nobody else's
                return False
            held.count -= 1
            if held.count == 0:
                store.free(key)
            return True

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._renew(key, owner, ttl, more=0)

    def _renew(self, key: str, owner: Owner, ttl: float, more: int) -> bool:
        """Renew ``owner``'s live lease for ``ttl`` seconds, counting ``more`` holds; False if it has none."""
        store = self._store
        with store.locked:
            now = time.monotonic()
            held = store.mine(key, owner, now)
            if held is None:
                return False
            held.count += more
            held.expires = now + ttl
            return True

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep until a release frees ``key`` or its lease runs out, at most ``remaining`` seconds."""
        store = self._store
        with store.locked:
            deadline = deadline_after(remaining)
            store.waiters[key] = store.waiters.get(key, 0) + 1
            try:
                while True:
                    now = time.monotonic()
                    held = store.live(key, now)
                    if held is None:
                        return
                    timeout = held.expires - now if deadline is None else min(held.expires, deadline) - now
                    if timeout <= 0:
                        return
                    store.locked.wait(timeout)
            finally:
                store.waiters[key] -= 1
                if not store.waiters[key]:
                    del store.waiters[key]

    def holder(self, key: str) -> LockInfo | None:
        store = self._store
        with store.locked:
            now = time.monotonic()
            held = store.live(key, now)
            return None if held is None else self._info(store, key, held, now)

    def held(self) -> Iterator[LockInfo]:
        store = self._store
        with store.locked:
            now = time.monotonic()
            found = [self._info(store, key, held, now) for key, held in store.held.items() if held.expires > now]
        yield from found
        yield from self._rw_held()

    def _info(self, store: _Store, key: str, held: _Held, now: float) -> LockInfo:
        return LockInfo(
            alias=self.alias,
            key=key,
            owner=held.owner,
            hold_count=held.count,
            token=held.token,
            acquired_at=held.acquired_at,
            expires_at=_utc(now, held.expires),
            waiters=store.waiters.get(key, 0),
        )

    def force_release(self, key: str, token: int | None = None) -> bool:
        store = self._store
        with store.locked:
            held = store.live(key, time.monotonic())
            if held is None or (token is not None and held.token != token):
                return False
            store.free(key)
            return True

    def clear_expired(self, dry_run: bool = False) -> int:
        """Forget expired holds; the fencing counters stay, so tokens keep growing."""
        store = self._store
        with store.locked:
            now = time.monotonic()
            expired = [key for key, held in store.held.items() if held.expires <= now]
            gone = [key for key, rw in store.rw.items() if not rw.writer and not rw.readers and not rw.waiting]
            for key, rw in store.rw.items():
                holds = [rw.writer, *rw.readers.values()] if rw.writer else list(rw.readers.values())
                found = sum(held.expires <= now for held in holds) + sum(until <= now for until in rw.waiting.values())
                expired.extend([key] * found)
                if found and not dry_run:
                    rw.prune(now)
                    if not rw.writer and not rw.readers and not rw.waiting:
                        gone.append(key)
            if not dry_run:
                for key in expired:
                    store.held.pop(key, None)
                for key in gone:
                    store.rw.pop(key, None)
            return len(expired)

    def _rw_held(self) -> list[LockInfo]:
        store = self._store
        with store.locked:
            now = time.monotonic()
            found = []
            for key, rw in store.rw.items():
                waiting = sum(until > now for until in rw.waiting.values())
                for mode in ("write", "read"):
                    for held in rw.side(mode).values():
                        if held.expires > now:
                            info = self._info(store, key, held, now)
                            found.append(dataclasses.replace(info, kind=mode, waiters=waiting))
            return found

    def expire(self, key: str) -> int | None:
        """End the lease of ``key`` now, as if its holder had not renewed it in time; return its token.

        The holder's renewals are asked for at once (``holds_in_doubt``), so
        the watchdog finds the loss now. None if the lock was not held.
        """
        store = self._store
        with store.locked:
            now = time.monotonic()
            held = store.live(key, now)
            if held is None:
                return None
            held.expires = now
            store.locked.notify_all()
        holds_in_doubt(self.alias)
        return held.token
