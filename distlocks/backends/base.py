"""Base lock backend class."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.arguments import check_positive_number
from distlocks.owner import Owner

DEFAULT_TTL = 30.0

# Who wants to know that a backend's holds may be gone (the watchdog registers
# here): backends tell the core through this, and never import it.
_doubt_listeners: list[Callable[[str], None]] = []


def on_holds_in_doubt(listener: Callable[[str], None]) -> None:
    """Call ``listener(alias)`` whenever a backend says its holds may be gone."""
    _doubt_listeners.append(listener)


def holds_in_doubt(alias: str) -> None:
    """Say that the holds on ``alias`` may be gone (a suspended or lost session): the core checks them now."""
    for listener in _doubt_listeners:
        listener(alias)


@dataclass(frozen=True)
class LockInfo:
    """A lock held right now, as the admin and ``distlocks_list`` show it."""

    alias: str
    #: The key the server stores: the lock's name with the alias's ``KEY_PREFIX`` (``make_key``).
    key: str
    owner: str
    hold_count: int
    token: int | None
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    waiters: int | None = None
    #: What kind of lock: "lock", "semaphore", "multi", "read" or "write" (a read-write lock's side), "leader".
    kind: str = "lock"

    def lease_left(self, now: datetime | None = None) -> float | None:
        """Seconds until the lease runs out (None: the backend has no lease, like ZooKeeper)."""
        if self.expires_at is None:
            return None
        return max(0.0, (self.expires_at - (now or datetime.now(timezone.utc))).total_seconds())

    def as_dict(self, now: datetime | None = None) -> dict[str, Any]:
        """The fields as JSON-ready values, with ``lease_left`` in seconds."""
        return {
            "alias": self.alias,
            "key": self.key,
            "owner": self.owner,
            "hold_count": self.hold_count,
            "token": self.token,
            "acquired_at": self.acquired_at.isoformat() if self.acquired_at else None,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "lease_left": self.lease_left(now),
            "waiters": self.waiters,
            "kind": self.kind,
        }


def deadline_after(wait: float | None) -> float | None:
    """The moment (monotonic) a wait of ``wait`` seconds ends; None if it never does."""
    return None if wait is None else time.monotonic() + wait


def time_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (monotonic), 0 once it has passed; None if it never comes."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Granted(int):
    """A fencing token granted before the attempt that returned it was sent: a release's hand-over to a waiter.

    The server began its lease at the grant, which a waiter may read long
    after (a paused process, a busy event loop): counted from that attempt, the
    lease would seem longer than the server keeps it. ``since`` (monotonic) is
    no later than the grant; the core counts the hold's lease from it.
    """

    since: float

    def __new__(cls, token: int, since: float) -> Granted:
        granted = super().__new__(cls, token)
        granted.since = since
        return granted


def lease_start(token: int, sent: float) -> float:
    """When the lease of ``token``, returned by an attempt sent at ``sent`` (monotonic), began at the latest."""
    return min(sent, token.since) if isinstance(token, Granted) else sent


def backoff(attempt: int, remaining: float | None) -> float:
    """Seconds to sleep before the next attempt: capped exponential backoff with jitter, at most ``remaining``."""
    delay = min(0.002 * 2 ** min(attempt, 5), 0.05) * random.uniform(0.5, 1.0)
    return delay if remaining is None else max(0.0, min(delay, remaining))


class AsyncTurn:
    """How an async lock (``distlocks.aio``) waits for ``key`` between attempts.

    The attempts and leaving run in a pool thread, the wait on the event loop.
    This default polls with the core's backoff; a backend whose server tells
    a waiter its turn (Redis) queues it and waits for the message instead.
    """

    def try_acquire(self, backend: BaseLockBackend, key: str, owner: Owner, ttl: float) -> int | None:
        """One attempt, in a pool thread: ``backend.try_acquire``, as this waiter."""
        return backend.try_acquire(key, owner, ttl)

    async def wait(self, attempt: int, remaining: float | None) -> None:
        """Sleep on the loop until the lock may be free, at most ``remaining`` seconds."""
        await asyncio.sleep(backoff(attempt, remaining))

    def end(self, acquired: bool) -> Callable[[BaseLockBackend], None] | None:
        """Stop waiting (on the loop); return what is left to do on the server in a pool thread, if anything."""
        return None


class AsyncPrimitives(Protocol):
    """A backend's lock calls as coroutines on the running event loop (``async_primitives``): no pool thread.

    ``distlocks.aio`` runs the lock's own steps (``DistributedLock._reenter``,
    ``_record``, ``_release``) on the loop and awaits these for their calls.
    """

    async def try_acquire(self, key: str, owner: Owner, ttl: float, turn: AsyncTurn) -> int | None:
        """One attempt as the waiter ``turn`` (made by ``async_turn``); its token, or None."""

    async def end_wait(self, turn: AsyncTurn, acquired: bool) -> None:
        """Stop waiting as ``turn`` (see ``AsyncTurn.end``), leaving the queue on the server if need be."""

    async def reenter(self, key: str, owner: Owner, ttl: float) -> bool: ...

    async def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool: ...

    async def release(self, key: str, owner: Owner) -> bool: ...

    async def release_token(self, key: str, owner: Owner, token: int) -> bool: ...


class BaseLockBackend:
    """Primitives a lock server offers; ``DistributedLock`` builds the lock on them.

    The interface, in one place (Django's ``BaseCache`` is the model). Every
    method takes the backend-level ``key`` (``make_key(name)``: the name with
    ``KEY_PREFIX``) and is one attempt: looping, deadlines, the calling thread's
    holds and its hold count live in the core (``lock.py``, ``holds.py``).

    Every backend provides:

    - ``try_acquire``, ``reenter``, ``release``, ``extend``: the lock itself.
      ``try_acquire`` takes a free lock only (the same owner again gets None:
      re-entry is the core's ``reenter``). The server keeps a copy of the hold
      count (``reenter`` adds one, ``release`` drops one, the lock is freed at
      zero) that the admin shows as ``LockInfo.hold_count``.

    Every backend may override (a default that works is given):

    - ``wait``: block until the lock may be free (default: sleep with backoff);
      ``begin_wait``/``end_wait`` bracket the attempts of one acquire that may wait.
    - ``holder``: the one lock of a key (default: looks through ``held()``).
    - ``ping``, ``check``, ``address``: reaching the server, system checks.

    A backend may offer, else NotImplementedError (callers degrade: the
    admin and the commands say the backend cannot):

    - ``held``, ``force_release``: the admin and ``distlocks_list``/``_release``.
    - ``clear_expired``: ``distlocks_cleanup``. One meaning everywhere: delete
      what locks no longer held left on the server (expired rows, unused
      fencing counters, empty nodes); ``cleanup_noun`` names those leftovers
      in the command's report, since they differ from server to server.

    - ``read_write_side(mode)``: a read-write lock's side ("read" or
      "write") as a lock backend of its own, with these same primitives and
      meanings on the side's key (see ``backends.sides.ReadWriteSide``); the
      backend names its class in ``side_class``. Its holds are listed by the
      backend's ``held()`` with ``kind`` "read" or "write".

    Session-bound backends (``session_bound``: a hold lives with the holding
    process's session, not as a lease) also provide ``drop``, and may provide
    ``record`` (the semaphore's permits marker there).
    """

    #: The longest key this backend stores, or None for no limit.
    max_key_length: int | None = None
    #: What ``clear_expired()`` deletes on this server, for the cleanup command's report.
    cleanup_noun = "expired locks"
    #: True if a hold lives as long as the holding process's session, not as a
    #: lease: another process can then never take it over (``detach``/``resume``).
    session_bound = False
    #: True if ``ttl`` is a lease: the core marks a hold lost once it ends
    #: without a renewal it can prove. False (ZooKeeper) when only the backend
    #: knows when a hold is gone (its ``extend`` says so: a session that may
    #: have expired); ``ttl`` then only paces the watchdog's checks.
    ttl_is_lease = True
    #: The keys of a DISTLOCKS entry this backend reads (``manage.py check`` reports any other as a typo).
    setting_names: tuple[str, ...] = ("BACKEND", "LOCATION", "OPTIONS", "TTL", "KEY_PREFIX")
    #: The ``OPTIONS`` keys this backend reads; None: not declared, so not checked.
    option_names: tuple[str, ...] | None = None
    #: What to set instead of LOCATION, if this backend does not read it (a LOCATION given is then an error).
    location_instead: str | None = None
    #: True if its locks are kept in distlocks' own tables (its migrations): "distlocks" must then be in
    #: INSTALLED_APPS (``manage.py check`` says so, and the first lock raises ImproperlyConfigured).
    needs_app = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        self.alias = alias
        self.location: str = params.get("LOCATION", "")
        options = params.get("OPTIONS", {})
        if not isinstance(options, dict):
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]['OPTIONS'] must be a dict")
        self.options: dict[str, Any] = dict(options)
        try:
            self.default_ttl = check_positive_number(params.get("TTL", DEFAULT_TTL), "TTL")
        except ValueError as exc:
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: {exc}") from exc
        self.key_prefix: str = str(params.get("KEY_PREFIX") or "")

    def make_key(self, name: str) -> str:
        """Return the backend-level key of a lock name, or raise ValueError if too long."""
        key = f"{self.key_prefix}:{name}" if self.key_prefix else name
        if self.max_key_length is not None and len(key) > self.max_key_length:
            room = self.max_key_length - (len(key) - len(name))
            raise ValueError(f"name is {len(name)} characters long; the {self.alias!r} backend takes at most {room}")
        return key

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        """Take a free (or expired) lock once; return its new fencing token, or None.

        A token whose lease began before this call (handed over while the caller waited) is a ``Granted``.
        """
        raise NotImplementedError("subclasses of BaseLockBackend must provide a try_acquire() method")

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        """Count one more hold by ``owner`` and renew the lease; False if it no longer holds it."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide a reenter() method")

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        """``reenter()`` ``owner``'s acquisition ``token`` of ``key`` only (see ``release_token``)."""
        return self.reenter(key, owner, ttl)

    def release(self, key: str, owner: Owner) -> bool:
        """Drop one hold, freeing the lock at zero; False if ``owner`` has no live lease."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide a release() method")

    def release_token(self, key: str, owner: Owner, token: int) -> bool:
        """``release()`` one hold of ``owner``'s acquisition ``token`` of ``key``: only that acquisition's.

        A backend whose requests may reach the server late (one stuck on a
        connection after its caller gave up on it) checks the token too, so
        that a stale release never frees a later acquisition by the same owner
        (a thread keeps its secret). The core releases, renews and re-enters
        a hold by its token (``*_token``); the plain forms serve a detached
        lease, whose token the caller may not know.
        """
        return self.release(key, owner)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        """Renew the lease for ``ttl`` seconds; False if ``owner`` has no live lease."""
        raise NotImplementedError("subclasses of BaseLockBackend must provide an extend() method")

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        """``extend()`` the lease of ``owner``'s acquisition ``token`` of ``key`` only (see ``release_token``)."""
        return self.extend(key, owner, ttl)

    def proven_until(self, key: str, owner: Owner, lease_ends: float) -> float:
        """Until when (monotonic) ``owner``'s hold of ``key`` is certainly still its own, with no request.

        ``lease_ends`` is the hold's lease as the core counts it (from before
        the request that took or last renewed it): no other owner can take the
        lock before then. A backend whose holds are no leases (ZooKeeper) says
        from what it knows of its session instead. A leader checks this before
        it acts (``distlocks.election``): a process paused past its lease finds
        it gone before the watchdog's thread has run.
        """
        return lease_ends

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Block until the lock may be free, at most ``remaining`` seconds.

        The default sleeps with capped exponential backoff and jitter, so that
        waiters in many processes do not retry in lockstep. Backends whose server
        can notify a release override it.
        """
        time.sleep(backoff(attempt, remaining))

    def begin_wait(self, key: str) -> None:
        """Get ready for an acquire that may wait: a backend that queues waiters may queue this one at once."""

    def end_wait(self, key: str, acquired: bool) -> None:
        """Forget this thread's attempt on ``key``: it ``acquired`` the lock, or gave up."""

    def async_turn(self, key: str) -> AsyncTurn:
        """A new async waiter for ``key`` (see AsyncTurn); called on the event loop."""
        return AsyncTurn()

    def async_primitives(self) -> AsyncPrimitives | None:
        """The lock calls as coroutines, for a backend whose client has an asyncio form; None: pool threads."""
        return None

    #: The class of a side of this backend's read-write locks (a ``backends.sides.ReadWriteSide``), if it has them.
    side_class: type[Any] | None = None

    def read_write_side(self, mode: str) -> BaseLockBackend:
        """The ``mode`` side ("read" or "write") of this backend's read-write locks, as a lock backend.

        One per backend instance and mode (so per thread); NotImplementedError
        if the backend has no read-write locks.
        """
        if self.side_class is None:
            raise NotImplementedError(f"the {self.alias!r} backend ({type(self).__name__}) has no read-write locks")
        sides: dict[str, BaseLockBackend] = self.__dict__.setdefault("_read_write_sides", {})
        found = sides.get(mode)
        if found is None:
            found = sides[mode] = self.side_class(self, mode)
        return found

    def holder(self, key: str) -> LockInfo | None:
        """The lock stored as ``key`` if it is held right now, else None.

        The default looks through ``held()``; a backend can ask its server for
        the one key instead.
        """
        return next((info for info in self.held() if info.key == key), None)

    def held(self) -> Iterator[LockInfo]:
        """Yield the locks held right now (for the admin and the commands)."""
        raise NotImplementedError("subclasses of BaseLockBackend may provide a held() method")

    def session_ended(self, key: str, owner: Owner) -> bool:
        """Whether ``owner``'s hold of ``key`` is known, in this process, to have ended with its session.

        A session-bound backend ends the session of a call that failed halfway
        (it may have taken or kept the server's lock): the hold went with it.
        False when not known (a lease backend's hold lives on the server).
        """
        return False

    def release_later(self, key: str, token: int) -> None:
        """The last release of ``key``'s acquisition ``token`` raised (an interrupt, a server that did not answer).

        It may never have reached the server: a backend that can frees that
        acquisition (and no later one) once the server answers, without
        blocking the caller. By default its lease runs out.
        """

    def drop(self, key: str, owner: Owner) -> bool:
        """Free ``owner``'s hold of ``key`` whatever its count, without blocking; False if it had none here.

        Session-bound backends provide it: their holds end with the session,
        not with a lease, so the hold of a thread that ended holding it (or one
        whose count can no longer be trusted) would stay for the life of the
        process. A lease backend's hold runs out by itself: nothing to do.
        """
        return False

    def record(self, key: str, value: str) -> str:
        """Store ``value`` under ``key`` unless a value is stored there already; return the stored one.

        Session-bound backends provide it (for a semaphore's permits count):
        their holds cannot be shared by owners in several processes, so such a
        value cannot be kept as a lease that every user renews.
        """
        raise NotImplementedError("subclasses of BaseLockBackend may provide a record() method")

    def force_release(self, key: str, token: int | None = None) -> bool:
        """Free a lock whoever holds it; return False if it was not held.

        With ``token``, free it only if it is still that acquisition (its fencing
        token is ``token``), compared and deleted in one step on the server, so
        that an operator who chose a lock never frees the next holder's.
        """
        raise NotImplementedError("subclasses of BaseLockBackend may provide a force_release() method")

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete what locks no longer held left on the server; return how many (or would be, with ``dry_run``)."""
        raise NotImplementedError("subclasses of BaseLockBackend may provide a clear_expired() method")

    @property
    def address(self) -> str:
        """Where the server is, for messages about reaching it."""
        return self.location or self.alias

    def ping(self) -> list[CheckMessage] | None:
        """Ask the server for a trivial answer; raise BackendUnavailable if none comes (in bounded time).

        A backend may return warnings about what the server said of its
        configuration: ``check()`` does no I/O, so ``manage.py check`` reports them from here.
        """
        return None

    def check(self) -> list[CheckMessage]:
        """Return system check messages about this backend's configuration (no I/O: see ``ping``)."""
        return []
