"""The kazoo session a process shares per alias: connection, contact with the server, orphan nodes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import holds_in_doubt
from distlocks.exceptions import BackendUnavailable

#: kazoo's own messages ("Connection dropped", "Connection time-out", every
#: retry of a reconnection): under distlocks, where a project's LOGGING finds
#: them, instead of kazoo's loggers, whose warnings Python's last-resort
#: handler prints to stderr when logging is not configured. The NullHandler
#: keeps them off stderr then too; configured handlers (root's, distlocks')
#: still get them, at kazoo's levels.
kazoo_logger = logging.getLogger("distlocks.backends.zookeeper.kazoo")
kazoo_logger.addHandler(logging.NullHandler())


class Session:
    """One kazoo client per process and alias, shared by every thread.

    It also knows which nodes this process holds, so that the watchdog thread
    can check them and a lost session can be reported at once, and when the
    server last heard from it, so that a hold is given up before its session
    can have expired on the server.
    """

    def __init__(
        self, alias: str, location: str, session_timeout: float, auth: list[tuple[str, str]], acl: list[Any] | None
    ) -> None:
        from kazoo.client import KazooClient
        from kazoo.protocol.states import KazooState
        from kazoo.security import CREATOR_ALL_ACL, READ_ACL_UNSAFE

        from distlocks.backends.zookeeper.polling import PollingHandler

        self.alias = alias
        self.location = location
        self.states = KazooState
        self.client = KazooClient(
            hosts=location,
            timeout=session_timeout,
            auth_data=auth or None,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
            command_retry={"max_tries": 0},
            logger=kazoo_logger,
            handler=PollingHandler(),
        )
        # With credentials, nodes only their identity may change (others may read).
        self.acl = acl
        if self.acl is None and auth:
            self.acl = [*CREATOR_ALL_ACL, *READ_ACL_UNSAFE]
        self.lock = threading.Lock()
        self.started = False
        # (key, owner secret) -> [node path, hold count, the token its data shows (node_data)]
        self.held: dict[tuple[str, str], list[Any]] = {}
        # Nodes of ours that a broken connection kept us from deleting, as
        # (lock node, name prefix): deleted when the connection is back, or they
        # would block the lock for as long as the session lives.
        self.orphans: set[tuple[str, str]] = set()
        # The server expires the session ``timeout`` seconds after it last heard
        # from us; ``contact`` is a moment it certainly heard from us (monotonic).
        self.timeout = session_timeout  # the negotiated one, once connected
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

    def unavailable(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(
            f"ZooKeeper {self.location!r} for locks on {self.alias!r} is unavailable: {exc!r}", alias=self.alias
        )

    def request(self, operation: str, *args: Any, limit: float, then: FollowUp | None = None, **kwargs: Any) -> Any:
        """Run ``client.<operation>`` for at most ``limit`` seconds; send ``then`` right behind it.

        kazoo queues requests while it reconnects; waiting on them unbounded
        could hang. A ``create`` that completes after we gave up is deleted
        again, so that no orphan node blocks the lock.
        """
        from kazoo.exceptions import (
            ConnectionClosedError,
            ConnectionLoss,
            NoNodeError,
            SessionExpiredError,
            SessionMovedError,
        )

        client = self.client
        if limit <= 0:
            # The caller's time is up (an acquire's wait and CONNECT_TIMEOUT): not sent at all.
            raise self.unavailable(TimeoutError("no time left to ask the server"))
        deadline = time.monotonic() + limit
        while True:
            sent = time.monotonic()
            pending = getattr(client, f"{operation}_async")(*args, **kwargs)
            try:
                if then is not None:
                    then.send(client)
                result = pending.get(timeout=max(0.0, deadline - time.monotonic()))
            except NoNodeError:
                self.heard(sent)
                raise
            except SessionExpiredError as exc:
                # Refused before it was sent: kazoo is opening a new session.
                if time.monotonic() > deadline:
                    raise self.unavailable(exc) from exc
                time.sleep(0.05)
                continue
            except (ConnectionLoss, ConnectionClosedError, SessionMovedError) as exc:
                # Moved: another connection took the session over (this one is
                # about to be dropped). Unavailable, so that a renewal gives the
                # hold up once the session may have expired: ttl does not.
                raise self.unavailable(exc) from exc
            except BaseException as exc:
                # Timed out, or interrupted while it waited (a signal handler raised):
                # a create that completes after we gave up is deleted again.
                if operation == "create":
                    pending.rawlink(lambda done: _delete_late(client, done))
                if isinstance(exc, client.handler.timeout_exception):
                    raise self.unavailable(exc) from exc
                raise
            self.heard(sent)
            return result

    def close(self) -> None:
        """Stop and close the client (in a thread of its own: kazoo may wait for its connection attempt)."""
        with contextlib.suppress(Exception):
            self.client.stop()
            self.client.close()


class FollowUp:
    """A request sent right behind another one, on the same connection, for no round trip of its own.

    ZooKeeper answers a session's requests in the order they were sent, so it
    sees what the first one did; unless kazoo sent that one again after it (a
    ``create`` with ``makepath`` whose parent was missing), or either failed.
    ``answer()`` is then None, and the caller asks plainly.
    """

    def __init__(self, operation: str, *args: Any, **kwargs: Any) -> None:
        self.operation, self.args, self.kwargs = operation, args, kwargs
        self.pending: Any = None

    def send(self, client: Any) -> None:
        self.pending = getattr(client, f"{self.operation}_async")(*self.args, **self.kwargs)

    def answer(self, limit: float) -> Any:
        """Its answer within ``limit`` seconds (one already here, even with none left), or None (not sent,
        failed, or too late)."""
        if self.pending is None:
            return None
        try:
            return self.pending.get(timeout=max(0.0, limit))
        except Exception:
            return None


def _delete_late(client: Any, done: Any) -> None:
    """Delete the node of a create that succeeded after we gave up waiting for it."""
    if done.successful():
        created = done.get()  # (path, stat) with include_data, else the path
        client.delete_async(created[0] if isinstance(created, tuple) else created)


# One session per process, alias and ensemble (settings may change under tests).
_sessions: dict[tuple[str, str], Session] = {}
_sessions_lock = threading.Lock()


def _forget_sessions_after_fork() -> None:
    """A forked child starts sessions of its own: the parent's belong to the parent (and to its threads)."""
    global _sessions_lock
    _sessions.clear()
    _sessions_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_sessions_after_fork)


def shared_session(
    alias: str,
    location: str,
    *,
    session_timeout: float,
    connect_timeout: float,
    auth: list[tuple[str, str]],
    acl: list[Any] | None,
) -> Session:
    """This process's session for ``alias`` on ``location``, created and started at the first call."""
    index = (alias, location)
    if connect_timeout <= 0 and index not in _sessions:
        raise BackendUnavailable(f"ZooKeeper {location!r} for locks on {alias!r}: no time left to connect", alias=alias)
    with _sessions_lock:
        session = _sessions.get(index)
        if session is None:
            try:
                session = Session(alias, location, session_timeout, auth, acl)
            except ImportError as exc:
                raise ImproperlyConfigured(
                    f"DISTLOCKS[{alias!r}] needs kazoo: pip install 'distlocks[zookeeper]'"
                ) from exc
            _sessions[index] = session
        if not session.started:
            # Started once: after that kazoo reconnects by itself, and a
            # second start() could close the session and its locks. kazoo's
            # start(timeout) stops a client that did not connect in time and
            # waits for its connection attempt to end (up to the session
            # timeout): the caller waits ``connect_timeout`` only, and a
            # client that did not connect is closed in the background and
            # replaced at the next call.
            try:
                live = session.client.start_async()
            except Exception as exc:  # a refused connection, or a host that does not resolve
                raise session.unavailable(exc) from exc
            if not live.wait(connect_timeout) or not session.client.connected:
                del _sessions[index]
                threading.Thread(target=session.close, name="distlocks-zookeeper-close", daemon=True).start()
                raise session.unavailable(TimeoutError(f"not connected within {connect_timeout:.2g}s"))
            session.started = True
    return session
