"""ZooKeeper lock backend on kazoo: ephemeral sequential nodes.

Guarantees: a lock on ``name`` is the lowest of the ephemeral sequential
children of ``ROOT/<name>``; a waiter watches only the child just below its own
(no herd) and gets the lock in the order it asked. An ephemeral node lives as
long as the session that created it, so a holder that crashes or is cut off
frees its lock when its session expires (``SESSION_TIMEOUT``), not after a
lease: on this backend ``ttl`` only sets how often the watchdog checks that the
node is still there. When the connection is ``SUSPENDED`` the holder cannot
know whether it still holds the lock, so renewals fail until it reconnects, and
the hold is lost if that takes longer than ``ttl``; when the session is
``LOST`` every lock held through it is lost at once (``lock_lost``, and
``LockLost`` on release).

The fencing token is the node's creation zxid: ZooKeeper's transaction ids only
grow, across leader elections and the deletion of empty lock parents, so it is
strictly increasing per lock name (and across all of them).

kazoo's ``Lock`` recipe is not used: it is not reentrant, it takes 4 requests
per acquire + release where 3 do (create, list, delete), and its tokens would
have to be read separately. Reentrancy is counted here, in the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo, check_positive_number
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

PREFIX = "lock-"


class _Session:
    """One kazoo client per process and alias, shared by every thread.

    It also knows which nodes this process holds, so that the watchdog thread
    can check them and a lost session can be reported at once.
    """

    def __init__(self, backend: ZooKeeperBackend) -> None:
        from kazoo.client import KazooClient
        from kazoo.protocol.states import KazooState

        self.lost_state = KazooState.LOST
        self.connected_state = KazooState.CONNECTED
        self.client = KazooClient(
            hosts=backend.location,
            timeout=backend.session_timeout,
            auth_data=backend.auth or None,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
            command_retry={"max_tries": 0},
        )
        self.lock = threading.Lock()
        self.started = False
        # (key, owner secret) -> [node path, hold count]
        self.held: dict[tuple[str, str], list[Any]] = {}
        # Nodes of ours that a broken connection kept us from deleting, as
        # (lock node, name prefix): deleted when the connection is back, or they
        # would block the lock for as long as the session lives.
        self.orphans: set[tuple[str, str]] = set()
        self.client.add_listener(self._on_state)

    def _on_state(self, state: Any) -> None:
        if state == self.lost_state:
            # The session and its ephemeral nodes are gone: every hold is lost.
            with self.lock:
                self.held.clear()
                self.orphans.clear()
            from distlocks.watchdog import watchdog

            watchdog().renew_soon()
        elif state == self.connected_state and self.orphans:
            self.client.handler.spawn(self.delete_orphans)  # a listener must not block

    def delete_orphans(self) -> None:
        from kazoo.exceptions import KazooException

        with self.lock:
            orphans = list(self.orphans)
        for parent, prefix in orphans:
            try:
                for child in self.client.get_children(parent):
                    if child.startswith(prefix):
                        self.client.delete(f"{parent}/{child}")
                with self.lock:
                    self.orphans.discard((parent, prefix))
            except KazooException:
                continue  # the next reconnection tries again


# One session per process, alias and ensemble (settings may change under tests).
_sessions: dict[tuple[int, str, str], _Session] = {}


def _sequence(child: str) -> str:
    """The sequence number ZooKeeper appended to a child's name (10 digits)."""
    return child[-10:]


def _in_order(children: list[str]) -> list[str]:
    return sorted(children, key=_sequence)


_sessions_lock = threading.Lock()


class ZooKeeperBackend(BaseLockBackend):
    """Locks as ephemeral sequential nodes under ``OPTIONS['ROOT']`` of a ZooKeeper ensemble."""

    max_key_length = 1024
    cleanup_noun = "empty lock nodes"
    session_bound = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        if not self.location or not isinstance(self.location, str):
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}] needs LOCATION, the ensemble's connect string ('host:port,host:port')"
            )
        self.root = str(self.options.get("ROOT", "/distlocks")).rstrip("/")
        if not self.root.startswith("/"):
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]['OPTIONS']['ROOT'] must start with '/'")
        try:
            self.session_timeout = check_positive_number(self.options.get("SESSION_TIMEOUT", 10.0), "SESSION_TIMEOUT")
            self.connect_timeout = check_positive_number(self.options.get("CONNECT_TIMEOUT", 5.0), "CONNECT_TIMEOUT")
        except ValueError as exc:
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]['OPTIONS']: {exc}") from exc
        self.auth: list[tuple[str, str]] = [(scheme, credential) for scheme, credential in self.options.get("AUTH", [])]
        # This thread's pending waits: key -> our node path while we queue.
        self._queued: dict[str, tuple[str, int]] = {}  # key -> (our node, its czxid)

    # -- the shared session ------------------------------------------------------

    def _session(self) -> _Session:
        index = (os.getpid(), self.alias, self.location)
        with _sessions_lock:
            session = _sessions.get(index)
            if session is None:
                try:
                    session = _Session(self)
                except ImportError as exc:
                    raise ImproperlyConfigured(
                        f"DISTLOCKS[{self.alias!r}] needs kazoo: pip install 'distlocks[zookeeper]'"
                    ) from exc
                _sessions[index] = session
            if not session.started:
                # Started once: after that kazoo reconnects by itself, and a
                # second start() could close the session and its locks.
                try:
                    session.client.start(timeout=self.connect_timeout)
                except Exception as exc:  # kazoo's time-out, or a refused connection
                    raise self._unavailable(exc) from exc
                session.started = True
        return session

    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(
            f"ZooKeeper {self.location!r} for locks on {self.alias!r} is unavailable: {exc!r}", alias=self.alias
        )

    def _request(self, operation: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``client.<operation>`` for at most ``CONNECT_TIMEOUT`` seconds.

        kazoo queues requests while it reconnects; waiting on them unbounded
        could hang. A ``create`` that completes after we gave up is deleted
        again, so that no orphan node blocks the lock.
        """
        from kazoo.exceptions import ConnectionClosedError, ConnectionLoss, SessionExpiredError

        client = self._session().client
        deadline = time.monotonic() + self.connect_timeout
        while True:
            pending = getattr(client, f"{operation}_async")(*args, **kwargs)
            try:
                return pending.get(timeout=max(0.0, deadline - time.monotonic()))
            except SessionExpiredError as exc:
                # Refused before it was sent: kazoo is opening a new session.
                if time.monotonic() > deadline:
                    raise self._unavailable(exc) from exc
                time.sleep(0.05)
            except (ConnectionLoss, ConnectionClosedError) as exc:
                raise self._unavailable(exc) from exc
            except client.handler.timeout_exception as exc:
                if operation == "create":
                    pending.rawlink(lambda done: done.successful() and client.delete_async(done.get()))
                raise self._unavailable(exc) from exc

    def _parent(self, key: str) -> str:
        return f"{self.root}/{quote(key, safe='')}"

    # -- the lock primitives -----------------------------------------------------

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        session = self._session()
        if key not in self._queued:
            self._queued[key] = self._create(key, owner)
        node, token = self._queued[key]
        children = _in_order(self._request("get_children", self._parent(key)))
        if node.rsplit("/", 1)[1] not in children:
            # Gone with a lost session: queue again, at the back.
            node, token = self._queued[key] = self._create(key, owner)
            children = _in_order(self._request("get_children", self._parent(key)))
        if f"{self._parent(key)}/{children[0]}" != node:
            return None  # queued: wait() watches the node just below ours
        del self._queued[key]
        with session.lock:
            session.held[key, owner.secret] = [node, 1]
        return token

    def _create(self, key: str, owner: Owner) -> tuple[str, int]:
        """Create our node, finding it again if the connection broke while creating it.

        The node's name carries a random id (as kazoo's recipe does), so that a
        create whose answer was lost is neither doubled nor left behind.
        """
        from kazoo.exceptions import NoNodeError

        mark = f"{PREFIX}{uuid.uuid4().hex}-"
        try:
            # The create's own answer carries the node's zxid: no extra request for the token.
            path, stat = self._request(
                "create",
                f"{self._parent(key)}/{mark}",
                f"{owner}|1".encode(),
                ephemeral=True,
                sequence=True,
                makepath=True,
                include_data=True,
            )
            return str(path), int(stat.czxid)
        except BackendUnavailable:
            session = self._session()
            with session.lock:
                session.orphans.add((self._parent(key), mark))
            with contextlib.suppress(BackendUnavailable, NoNodeError):
                for child in self._request("get_children", self._parent(key)):
                    if child.startswith(mark):
                        self._request("delete", f"{self._parent(key)}/{child}")
            raise

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait for the deletion of the node just below ours (at most ``remaining`` seconds)."""
        queued = self._queued.get(key)
        if queued is None:
            return
        node = queued[0]
        children = _in_order(self._request("get_children", self._parent(key)))
        mine = node.rsplit("/", 1)[1]
        if mine not in children:
            return  # gone with a lost session: the next attempt queues again
        below = [child for child in children if _sequence(child) < _sequence(mine)]
        if not below:
            return
        gone = threading.Event()
        if self._request("exists", f"{self._parent(key)}/{below[-1]}", watch=lambda event: gone.set()) is None:
            return
        # Look again now and then: a lost session must not leave us waiting forever.
        gone.wait(1.0 if remaining is None else min(remaining, 1.0))

    def end_wait(self, key: str, acquired: bool) -> None:
        queued = self._queued.pop(key, None)
        if queued is not None and not acquired:
            node = queued[0]
            from kazoo.exceptions import NoNodeError

            try:
                self._request("delete", node)
            except NoNodeError:
                pass  # gone with its session
            except BackendUnavailable:
                self._orphan(node)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        session = self._session()
        with session.lock:
            entry = session.held.get((key, owner.secret))
            if entry is None:
                return False
            entry[1] += 1
        self._show_count(entry[0], owner, entry[1])
        return True

    def _show_count(self, node: str, owner: Owner, count: int) -> None:
        """Write the hold count into the node, for the admin (re-entry only: it costs a request)."""
        from kazoo.exceptions import NoNodeError

        with contextlib.suppress(NoNodeError):
            self._request("set", node, f"{owner}|{count}".encode())

    def release(self, key: str, owner: Owner) -> bool:
        from kazoo.exceptions import NoNodeError

        session = self._session()
        with session.lock:
            entry = session.held.get((key, owner.secret))
            if entry is None:
                return False
            entry[1] -= 1
            left = entry[1]
            if left == 0:
                del session.held[key, owner.secret]
        if left > 0:
            self._show_count(entry[0], owner, left)
            return True
        try:
            self._request("delete", entry[0])
        except NoNodeError:
            return False  # its session expired, or it was force-released
        except BackendUnavailable:
            self._orphan(entry[0])  # else it holds the lock for as long as the session lives
            raise
        return True

    def _orphan(self, node: str) -> None:
        """Delete ``node`` as soon as the connection allows."""
        session = self._session()
        parent, name = node.rsplit("/", 1)
        with session.lock:
            session.orphans.add((parent, name))
        if session.client.connected:
            session.client.handler.spawn(session.delete_orphans)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        session = self._session()
        with session.lock:
            entry = session.held.get((key, owner.secret))
        if entry is None:
            return False
        if not session.client.connected:
            # SUSPENDED: we cannot know; the watchdog retries until the ttl ends.
            raise self._unavailable(ConnectionError("the connection is suspended"))
        return self._request("exists", entry[0]) is not None

    # -- inspection and maintenance ----------------------------------------------

    def _locks(self) -> list[str]:
        from kazoo.exceptions import NoNodeError

        try:
            return list(self._request("get_children", self.root))
        except NoNodeError:
            return []

    def held(self) -> Iterator[LockInfo]:
        from kazoo.exceptions import NoNodeError

        for escaped in self._locks():
            parent = f"{self.root}/{escaped}"
            try:
                children = _in_order(self._request("get_children", parent))
                if not children:
                    continue
                data, stat = self._request("get", f"{parent}/{children[0]}")
            except NoNodeError:
                continue
            holder, _, count = data.decode(errors="replace").rpartition("|")
            yield LockInfo(
                alias=self.alias,
                name=unquote(escaped),
                owner=holder,
                hold_count=int(count) if count.isdigit() else 1,
                token=int(stat.czxid),
                acquired_at=datetime.fromtimestamp(stat.ctime / 1000, UTC),
                waiters=len(children) - 1,
            )

    def force_release(self, key: str) -> bool:
        from kazoo.exceptions import NoNodeError

        try:
            children = _in_order(self._request("get_children", self._parent(key)))
            if not children:
                return False
            self._request("delete", f"{self._parent(key)}/{children[0]}")
        except NoNodeError:
            return False
        return True

    def clear_expired(self, dry_run: bool = False) -> int:
        """Delete empty lock nodes (Curator's reaper); a new acquirer recreates its own.

        Deleting a node that has children fails, so a lock taken meanwhile is
        never touched; tokens are zxids, which keep growing either way.
        """
        from kazoo.exceptions import NoNodeError, NotEmptyError

        reaped = 0
        for escaped in self._locks():
            parent = f"{self.root}/{escaped}"
            try:
                stat = self._request("exists", parent)
                if stat is None or stat.numChildren:
                    continue
                if not dry_run:
                    self._request("delete", parent, version=stat.version)
                reaped += 1
            except (NoNodeError, NotEmptyError):
                continue
            except Exception as exc:  # BadVersionError: it was used meanwhile
                if type(exc).__name__ != "BadVersionError":
                    raise
        return reaped

    def ping(self) -> None:
        self._request("exists", self.root)

    def check(self) -> list[checks.CheckMessage]:
        try:
            import kazoo  # noqa: F401
        except ImportError:
            return [
                checks.Error(
                    f"DISTLOCKS[{self.alias!r}] needs kazoo.",
                    hint="pip install 'distlocks[zookeeper]'",
                    id="distlocks.E006",
                )
            ]
        return []
