"""ZooKeeper lock backend on kazoo: ephemeral sequential nodes.

Guarantees: a lock on ``name`` is the lowest of distlocks' ephemeral
sequential children (``lock-<id>-<sequence>``) of ``ROOT/<name>``; other
children (a stranger's) neither block nor hold it. A waiter watches only the
child just below its own (no herd) and gets the lock in the order it asked.
An ephemeral node lives as long as the session that created it, so a holder
that crashes or is cut off frees its lock when its session expires
(``SESSION_TIMEOUT``), not after a lease: on this backend ``ttl`` only sets how
often the watchdog checks that the node is still there.

Faults: when the connection is ``SUSPENDED`` the holder cannot know whether it
still holds the lock. Its holds are checked at once and renewals fail until it
reconnects; once the negotiated session timeout has passed since the server
last heard from this process (the send time of the last answered ping or
request), the server may have expired the session and handed the lock on, so
every hold is given up (``lock_lost``, and ``LockLost`` on release) and its node
is deleted if the session comes back after all. When the session is ``LOST``
every lock held through it is lost at once. Re-entering or releasing a lock
whose node is gone (force-released) raises ``LockLost``. A node is never left to
"expire", as no lease would end it: a hold whose last release, ``drop()`` (a
thread that ended holding it) or creation could not reach the server is
deleted in the background as soon as the connection allows, and an inner
release or a failed re-entry never puts the hold count out of step.

The fencing token is the node's creation zxid: ZooKeeper's transaction ids only
grow, across leader elections and the deletion of empty lock parents, so it is
strictly increasing per lock name (and across all of them). ``force_release``
with a token deletes exactly the node created at that zxid, never a later
holder's.

Access: with ``OPTIONS['AUTH']`` (e.g. ``[("digest", "user:password")]``), lock
nodes and the parents distlocks creates get ``CREATOR_ALL_ACL`` plus world read:
only that identity can create, change or delete them. ZooKeeper checks a
deletion against the parent's ACL, and a ``ROOT`` or lock parent that existed
before keeps its own: turn ``AUTH`` on with a fresh ``ROOT``.
``OPTIONS['ACL']`` replaces that default: a list of ``kazoo.security.ACL``
(e.g. ``[make_digest_acl("user", "password", all=True)]``). Without either,
nodes are world-writable, as kazoo creates them.

Names: any name works; ``.`` and ``..`` (which ZooKeeper refuses as node names)
are stored as ``%2E`` and ``%2E%2E``, every other character as ``quote()``
escapes it.

kazoo's ``Lock`` recipe is not used: it is not reentrant, it takes 4 requests
per acquire + release where 3 do (create, list, delete), and its tokens would
have to be read separately. Reentrancy is counted here, in the process.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo, check_positive_number, holds_in_doubt
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

PREFIX = "lock-"


class _Session:
    """One kazoo client per process and alias, shared by every thread.

    It also knows which nodes this process holds, so that the watchdog thread
    can check them and a lost session can be reported at once, and when the
    server last heard from it, so that a hold is given up before its session
    can have expired on the server.
    """

    def __init__(self, backend: ZooKeeperBackend) -> None:
        from kazoo.client import KazooClient
        from kazoo.protocol.states import KazooState
        from kazoo.security import CREATOR_ALL_ACL, READ_ACL_UNSAFE

        self.alias = backend.alias
        self.states = KazooState
        self.client = KazooClient(
            hosts=backend.location,
            timeout=backend.session_timeout,
            auth_data=backend.auth or None,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
            command_retry={"max_tries": 0},
        )
        # With credentials, nodes only their identity may change (others may read).
        self.acl: list[Any] | None = backend.acl
        if self.acl is None and backend.auth:
            self.acl = [*CREATOR_ALL_ACL, *READ_ACL_UNSAFE]
        self.lock = threading.Lock()
        self.started = False
        # (key, owner secret) -> [node path, hold count]
        self.held: dict[tuple[str, str], list[Any]] = {}
        # Nodes of ours that a broken connection kept us from deleting, as
        # (lock node, name prefix): deleted when the connection is back, or they
        # would block the lock for as long as the session lives.
        self.orphans: set[tuple[str, str]] = set()
        # The server expires the session ``timeout`` seconds after it last heard
        # from us; ``contact`` is a moment it certainly heard from us (monotonic).
        self.timeout = backend.session_timeout  # the negotiated one, once connected
        self.contact = time.monotonic()
        self._ping_sent = 0.0
        self._note_contacts()
        self.client.add_listener(self._on_state)

    def heard(self, sent: float) -> None:
        """The server answered what we sent at ``sent``: it heard from us then, or later."""
        if sent > self.contact:
            self.contact = sent  # a lost race keeps the older moment: still a safe bound

    def may_have_expired(self) -> bool:
        """True if the server may have expired our session (and deleted our nodes) by now."""
        return time.monotonic() - self.contact >= self.timeout

    def _note_contacts(self) -> None:
        """Learn from kazoo's connection the negotiated session timeout and the answered pings.

        kazoo tells neither, and declares SUSPENDED only after a ping went
        unanswered, so that moment is already late. An answer proves that the
        server heard the request when it was sent, not when the answer came:
        the send time is the contact. Without these hooks (another kazoo) our
        own requests are the only contacts and the timeout asked for is used,
        which is earlier than the truth unless the server lowered it.
        """
        from kazoo.protocol.serialization import Connect

        connection = getattr(self.client, "_connection", None)
        invoke = getattr(connection, "_invoke", None)
        send_ping = getattr(connection, "_send_ping", None)
        read_socket = getattr(connection, "_read_socket", None)
        pinging = getattr(connection, "ping_outstanding", None)
        if not (callable(invoke) and callable(send_ping) and callable(read_socket) and pinging is not None):
            return

        def invoke_noting(timeout: float, request: Any, xid: int | None = None) -> Any:
            sent = time.monotonic()
            result = invoke(timeout, request, xid)
            if isinstance(request, Connect) and result[0].time_out > 0:
                self.timeout = result[0].time_out / 1000
                self.heard(sent)
            return result

        def send_ping_noting(timeout: float) -> Any:
            if not pinging.is_set():
                self._ping_sent = time.monotonic()  # the oldest unanswered ping
            return send_ping(timeout)

        def read_socket_noting(timeout: float) -> Any:
            waiting = pinging.is_set()
            result = read_socket(timeout)
            if waiting and not pinging.is_set():
                self.heard(self._ping_sent)
            return result

        connection._invoke = invoke_noting  # type: ignore[union-attr]
        connection._send_ping = send_ping_noting  # type: ignore[union-attr]
        connection._read_socket = read_socket_noting  # type: ignore[union-attr]

    def _on_state(self, state: Any) -> None:
        # A listener must not block kazoo's connection thread: work is spawned.
        if state == self.states.LOST:
            # The session and its ephemeral nodes are gone: every hold is lost.
            with self.lock:
                self.held.clear()
                self.orphans.clear()
            self.client.handler.spawn(holds_in_doubt, self.alias)
        elif state == self.states.SUSPENDED:
            # Our holds may be gone: extend() tells, once the session can have expired.
            self.client.handler.spawn(holds_in_doubt, self.alias)
        elif state == self.states.CONNECTED and self.orphans:
            self.client.handler.spawn(self.delete_orphans)

    def orphan(self, node: str) -> None:
        """Delete ``node`` (or the nodes whose name starts like it) as soon as the connection allows."""
        parent, name = node.rsplit("/", 1)
        with self.lock:
            self.orphans.add((parent, name))
        if self.client.connected:
            # Requests are answered in order: this sees a create sent before it.
            self.client.handler.spawn(self.delete_orphans)

    def delete_orphans(self) -> None:
        from kazoo.exceptions import KazooException, NoNodeError

        with self.lock:
            orphans = list(self.orphans)
        for parent, prefix in orphans:
            try:
                for child in self.client.get_children(parent):
                    if child.startswith(prefix):
                        with contextlib.suppress(NoNodeError):
                            self.client.delete(f"{parent}/{child}")
            except NoNodeError:
                pass  # the lock node itself is gone, and ours with it
            except KazooException:
                continue  # the next reconnection tries again
            with self.lock:
                self.orphans.discard((parent, prefix))


# One session per process, alias and ensemble (settings may change under tests).
_sessions: dict[tuple[int, str, str], _Session] = {}

# Our nodes' names: PREFIX, a random id, and the sequence number ZooKeeper appends.
_OURS = re.compile(re.escape(PREFIX) + r"[0-9a-f]{32}-[0-9]{10}")


def _sequence(child: str) -> str:
    """The sequence number ZooKeeper appended to a child's name (10 digits)."""
    return child[-10:]


def _queue(children: list[str]) -> list[str]:
    """Our nodes among a lock's children, in queue order: a stranger's child neither blocks nor holds."""
    return sorted((child for child in children if _OURS.fullmatch(child)), key=_sequence)


def _delete_late(client: Any, done: Any) -> None:
    """Delete the node of a create that succeeded after we gave up waiting for it."""
    if done.successful():
        created = done.get()  # (path, stat) with include_data, else the path
        client.delete_async(created[0] if isinstance(created, tuple) else created)


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
        acl = self.options.get("ACL")
        if acl is not None and (
            not isinstance(acl, list | tuple)
            or not acl
            or not all(hasattr(entry, "perms") and hasattr(entry, "id") for entry in acl)
        ):
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}]['OPTIONS']['ACL'] must be a non-empty list of kazoo.security.ACL "
                "(for example [make_digest_acl('user', 'password', all=True)])"
            )
        self.acl: list[Any] | None = None if acl is None else list(acl)
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

    def _request(self, operation: str, *args: Any, limit: float | None = None, **kwargs: Any) -> Any:
        """Run ``client.<operation>`` for at most ``limit`` seconds (default ``CONNECT_TIMEOUT``).

        kazoo queues requests while it reconnects; waiting on them unbounded
        could hang. A ``create`` that completes after we gave up is deleted
        again, so that no orphan node blocks the lock.
        """
        from kazoo.exceptions import ConnectionClosedError, ConnectionLoss, NoNodeError, SessionExpiredError

        session = self._session()
        client = session.client
        deadline = time.monotonic() + (self.connect_timeout if limit is None else limit)
        while True:
            sent = time.monotonic()
            pending = getattr(client, f"{operation}_async")(*args, **kwargs)
            try:
                result = pending.get(timeout=max(0.0, deadline - time.monotonic()))
            except NoNodeError:
                session.heard(sent)
                raise
            except SessionExpiredError as exc:
                # Refused before it was sent: kazoo is opening a new session.
                if time.monotonic() > deadline:
                    raise self._unavailable(exc) from exc
                time.sleep(0.05)
                continue
            except (ConnectionLoss, ConnectionClosedError) as exc:
                raise self._unavailable(exc) from exc
            except client.handler.timeout_exception as exc:
                if operation == "create":
                    pending.rawlink(lambda done: _delete_late(client, done))
                raise self._unavailable(exc) from exc
            session.heard(sent)
            return result

    def _parent(self, key: str) -> str:
        escaped = quote(key, safe="")
        if escaped in (".", ".."):
            escaped = escaped.replace(".", "%2E")  # ZooKeeper refuses them as names; quote() never writes %2E
        return f"{self.root}/{escaped}"

    # -- the lock primitives -----------------------------------------------------

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        session = self._session()
        if key not in self._queued:
            self._queued[key] = self._create(key, owner)
        node, token = self._queued[key]
        children = _queue(self._request("get_children", self._parent(key)))
        if node.rsplit("/", 1)[1] not in children:
            # Gone with a lost session: queue again, at the back.
            node, token = self._queued[key] = self._create(key, owner)
            children = _queue(self._request("get_children", self._parent(key)))
        if not children or f"{self._parent(key)}/{children[0]}" != node:
            return None  # queued: wait() watches the node just below ours
        del self._queued[key]
        with session.lock:
            session.held[key, owner.secret] = [node, 1]
        return token

    def _create(self, key: str, owner: Owner) -> tuple[str, int]:
        """Create our node; if we cannot tell whether it was created, have it deleted.

        The node's name carries a random id (as kazoo's recipe does), so that a
        create whose answer was lost is neither doubled nor left behind.
        """
        mark = f"{PREFIX}{uuid.uuid4().hex}-"
        try:
            # The create's own answer carries the node's zxid: no extra request for the token.
            path, stat = self._request(
                "create",
                f"{self._parent(key)}/{mark}",
                f"{owner}|1".encode(),
                acl=self._session().acl,
                ephemeral=True,
                sequence=True,
                makepath=True,
                include_data=True,
            )
            return str(path), int(stat.czxid)
        except BackendUnavailable:
            self._session().orphan(f"{self._parent(key)}/{mark}")
            raise

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait for the deletion of the node just below ours (at most ``remaining`` seconds)."""
        queued = self._queued.get(key)
        if queued is None:
            return
        node = queued[0]
        children = _queue(self._request("get_children", self._parent(key)))
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
            from kazoo.exceptions import NoNodeError

            try:
                self._request("delete", queued[0])
            except NoNodeError:
                pass  # gone with its session
            except BackendUnavailable:
                self._session().orphan(queued[0])

    def _forget(self, key: str, owner: Owner) -> list[Any] | None:
        """Stop counting ``owner``'s hold of ``key`` (the core marks it lost); return its entry."""
        session = self._session()
        with session.lock:
            return session.held.pop((key, owner.secret), None)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        session = self._session()
        with session.lock:
            entry = session.held.get((key, owner.secret))
            if entry is None:
                return False
            entry[1] += 1
            count = entry[1]
        try:
            # Writing the count also proves the node is still there (not force-released).
            present = self._show_count(entry[0], owner, count)
        except BaseException:
            with session.lock:
                entry[1] -= 1  # the core does not count a re-entry that raised
            raise
        if not present:
            self._forget(key, owner)
        return present

    def _show_count(self, node: str, owner: Owner, count: int) -> bool:
        """Write the hold count into the node, for the admin; False if the node is gone."""
        from kazoo.exceptions import NoNodeError

        try:
            self._request("set", node, f"{owner}|{count}".encode())
        except NoNodeError:
            return False
        return True

    def release(self, key: str, owner: Owner) -> bool:
        """Drop one hold; delete the node at the last.

        An inner release only updates the count shown to operators: if the
        server cannot be reached for that, the count in this process (the one
        that decides) is still right, so it does not fail. The last release's
        node is deleted as soon as the connection allows if the server cannot be
        reached (BackendUnavailable is raised all the same).
        """
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
            try:
                present = self._show_count(entry[0], owner, left)
            except BackendUnavailable:
                return True
            if not present:
                self._forget(key, owner)
            return present
        try:
            self._request("delete", entry[0])
        except NoNodeError:
            return False  # its session expired, or it was force-released
        except BackendUnavailable:
            session.orphan(entry[0])  # else it holds the lock for as long as the session lives
            raise
        return True

    def drop(self, key: str, owner: Owner) -> bool:
        """Free ``owner``'s hold of ``key`` whatever its count (its thread ended holding it); False if none.

        Nothing else would ever free it: the session outlives the thread. The
        node is deleted in the background, at once or as soon as the connection
        allows: this never blocks nor raises BackendUnavailable.
        """
        entry = self._forget(key, owner)
        if entry is None:
            return False
        self._session().orphan(entry[0])
        return True

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        """Check that the node is still there; False once the session may have expired.

        While the server cannot be reached this raises BackendUnavailable (the
        watchdog retries) until the session timeout has passed since the server
        last heard from us: the server may then have deleted the node and given
        the lock to the next waiter, so the hold is given up (and its node
        deleted if the session comes back after all).
        """
        session = self._session()
        with session.lock:
            entry = session.held.get((key, owner.secret))
        if entry is None:
            return False
        try:
            if not session.client.connected:
                raise self._unavailable(ConnectionError("the connection is suspended"))
            left = session.contact + session.timeout - time.monotonic()
            # Not past the moment the session may expire (kazoo may not have noticed a silent server yet).
            limit = min(self.connect_timeout, max(left, 0.5))
            if self._request("exists", entry[0], limit=limit) is not None:
                return True
            self._forget(key, owner)
            return False
        except BackendUnavailable:
            if not session.may_have_expired():
                raise
        self.drop(key, owner)
        return False

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
                children = _queue(self._request("get_children", parent))
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

    def force_release(self, key: str, token: int | None = None) -> bool:
        """Delete the holder's node; with ``token``, only if that node's czxid is ``token``.

        A node's path names one acquisition (its sequence number is never
        reused), so checking its czxid and then deleting exactly that path
        never frees a later holder's lock.
        """
        from kazoo.exceptions import NoNodeError

        parent = self._parent(key)
        try:
            children = _queue(self._request("get_children", parent))
            if not children:
                return False
            head = f"{parent}/{children[0]}"
            if token is not None:
                stat = self._request("exists", head)
                if stat is None or int(stat.czxid) != token:
                    return False
            self._request("delete", head)
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
