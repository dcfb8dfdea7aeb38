"""ZooKeeper lock backend on kazoo: ephemeral sequential nodes (see the package docstring)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.arguments import check_positive_number
from distlocks.backends.base import AsyncTurn, BaseLockBackend, LockInfo
from distlocks.backends.zookeeper.inspection import Inspection
from distlocks.backends.zookeeper.nodes import escape, new_mark, node_data, queue, sequence
from distlocks.backends.zookeeper.rw import ZooKeeperSide
from distlocks.backends.zookeeper.session import FollowUp, Session, shared_session
from distlocks.backends.zookeeper.turn import ZooKeeperTurn
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner


class ZooKeeperBackend(BaseLockBackend):
    """Locks as ephemeral sequential nodes under ``OPTIONS['ROOT']`` of a ZooKeeper ensemble."""

    max_key_length = 1024
    cleanup_noun = "empty lock nodes"
    session_bound = True
    ttl_is_lease = False  # a hold lives with its session (see the package docstring)
    side_class = ZooKeeperSide
    option_names = ("ROOT", "SESSION_TIMEOUT", "CONNECT_TIMEOUT", "AUTH", "ACL")

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
        # What the last attempt that queued listed, for the wait after it: key -> the lock's children.
        self._listed: dict[str, list[str]] = {}
        # This thread's acquire under way must be over by then (monotonic): its
        # wait and CONNECT_TIMEOUT, whatever its requests (None: no acquire).
        self._until: float | None = None
        self._inspection = Inspection(alias, self.root, self._request)

    # -- the shared session ------------------------------------------------------

    def _session(self) -> Session:
        return shared_session(
            self.alias,
            self.location,
            session_timeout=self.session_timeout,
            connect_timeout=self._time_left(),
            auth=self.auth,
            acl=self.acl,
        )

    def _time_left(self) -> float:
        """How long the next request may take: ``CONNECT_TIMEOUT``, and no longer than the acquire under way."""
        if self._until is None:
            return self.connect_timeout
        return min(self.connect_timeout, self._until - time.monotonic())

    def _request(
        self, operation: str, *args: Any, limit: float | None = None, then: FollowUp | None = None, **kwargs: Any
    ) -> Any:
        """Run ``client.<operation>`` for at most ``limit`` seconds (default ``_time_left()``), ``then`` behind it."""
        limit = self._time_left() if limit is None else limit
        return self._session().request(operation, *args, limit=limit, then=then, **kwargs)

    def _children(self, listing: FollowUp | None, node: str, parent: str, **kwargs: Any) -> Any:
        """The children of ``parent`` (the answer of ``get_children``): ``listing``'s if it was sent behind the
        create of our ``node`` and shows it, else asked now."""
        listed = None if listing is None else listing.answer(self._time_left())
        names = listed[0] if kwargs.get("include_data") and listed is not None else listed
        if names is None or node.rsplit("/", 1)[1] not in names:
            return self._request("get_children", parent, **kwargs)
        return listed

    # -- an acquire's time: its requests end within its wait and CONNECT_TIMEOUT --

    def begin_wait(self, key: str) -> None:
        self._until = time.monotonic() + self.connect_timeout  # the first attempt's

    def _begin_attempt(self) -> None:
        if self._until is None:  # wait=0 (no begin_wait), or a task's attempt
            self._until = time.monotonic() + self.connect_timeout

    def _wait_for(self, remaining: float | None) -> None:
        """The acquire waits ``remaining`` seconds more (None: for ever): its requests may end that much later."""
        if remaining is None:
            self._until = None  # each attempt gets CONNECT_TIMEOUT
        else:
            self._until = max(self._until or 0.0, time.monotonic() + remaining + self.connect_timeout)

    def _parent(self, key: str) -> str:
        return f"{self.root}/{escape(key)}"

    # -- the lock primitives -----------------------------------------------------

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        session = self._session()
        self._begin_attempt()
        self._listed.pop(key, None)
        parent = self._parent(key)
        listing = None
        if key not in self._queued:
            listing = FollowUp("get_children", parent)
            self._queued[key] = self._create(key, owner, then=listing)
        node, token = self._queued[key]
        children = queue(self._children(listing, node, parent))
        if node.rsplit("/", 1)[1] not in children:
            # Gone with a lost session: queue again, at the back.
            node, token = self._queued[key] = self._create(key, owner)
            children = queue(self._request("get_children", parent))
        if not children or f"{parent}/{children[0]}" != node:
            self._listed[key] = children
            return None  # queued: wait() watches the node just below ours
        del self._queued[key]
        with session.lock:
            session.held[key, owner.secret] = [node, 1, ""]  # node, hold count, token shown in its data
        return token

    def _create(self, key: str, owner: Owner, mark: str | None = None, then: FollowUp | None = None) -> tuple[str, int]:
        """Create our node, ``then`` sent right behind it; if we cannot tell whether it was created, have it deleted.

        The node's name carries a random id (as kazoo's recipe does), so that a
        create whose answer was lost is neither doubled nor left behind.
        """
        mark = mark or new_mark()
        try:
            # The create's own answer carries the node's zxid: no extra request for the token.
            path, stat = self._request(
                "create",
                f"{self._parent(key)}/{mark}",
                node_data(owner, 1),
                acl=self._session().acl,
                ephemeral=True,
                sequence=True,
                makepath=True,
                include_data=True,
                then=then,
            )
            return str(path), int(stat.czxid)
        except BaseException:  # unavailable, or interrupted (a signal handler raised) while it waited
            self._session().orphan(f"{self._parent(key)}/{mark}")
            raise

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait for the deletion of the node just below ours (at most ``remaining`` seconds)."""
        self._wait_for(remaining)
        blocker = self.blocker(key)
        if blocker is not None:
            self._wait_gone(blocker, remaining)

    def blocker(self, key: str) -> str | None:
        """The node just below our queued node, to watch; None: try again now."""
        return self._last_ahead(
            key, self._parent(key), lambda nodes, mine: [n for n in queue(nodes) if sequence(n) < sequence(mine)]
        )

    def _last_ahead(self, key: str, parent: str, ahead: Callable[[list[str], str], list[str]]) -> str | None:
        """The last of ``ahead(children of parent, our node)``, the nodes our queued node for ``key`` waits for.

        None: try again now (nothing queued, our node gone with a lost
        session, or nothing ahead).
        """
        queued = self._queued.get(key)
        listed = self._listed.pop(key, None)
        if queued is None:
            return None
        # The attempt just before listed them (nodes gone since are seen gone when watched): no request.
        children = self._request("get_children", parent) if listed is None else listed
        mine = queued[0].rsplit("/", 1)[1]
        if mine not in children:
            return None  # gone with a lost session: the next attempt queues again
        nodes = ahead(children, mine)
        return f"{parent}/{nodes[-1]}" if nodes else None

    def async_turn(self, key: str) -> AsyncTurn:
        return ZooKeeperTurn(key)

    def _wait_gone(self, node: str, remaining: float | None) -> None:
        """Wait until ``node`` is deleted, at most ``remaining`` seconds and at most a second."""
        gone = threading.Event()
        if self._request("exists", node, watch=lambda event: gone.set()) is None:
            return
        # Look again now and then: a lost session must not leave us waiting forever.
        gone.wait(1.0 if remaining is None else min(remaining, 1.0))

    def end_wait(self, key: str, acquired: bool) -> None:
        self._listed.pop(key, None)
        queued = self._queued.pop(key, None)
        try:
            if queued is not None and not acquired:
                self.leave(queued[0])
        finally:
            self._until = None

    def leave(self, node: str) -> None:
        """Delete our queued ``node`` (a waiter that gives up): at once, or as soon as the connection allows.

        With the acquire's time up, or no connection, it is deleted in the
        background (``orphan``): the caller does not wait for it.
        """
        from kazoo.exceptions import NoNodeError

        try:
            session = self._session()
        except BackendUnavailable:
            return  # a session that never connected created no node
        try:
            if session.client.connected and self._time_left() > 0:
                self._request("delete", node)
                return
        except NoNodeError:
            return  # gone with its session
        except BackendUnavailable:
            pass
        session.orphan(node)

    def leave_by(self, node: str, ends: float | None) -> None:
        """``leave`` for an acquire whose wait ended at ``ends`` (a task's, in a pool thread): within CONNECT_TIMEOUT of it."""
        self._until = None if ends is None else ends + self.connect_timeout
        try:
            self.leave(node)
        finally:
            self._until = None

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
            present = self._show_count(entry, owner, count)
        except BaseException:
            with session.lock:
                entry[1] -= 1  # the core does not count a re-entry that raised
            raise
        if not present:
            self._forget(key, owner)
        return present

    def _show_count(self, entry: list[Any], owner: Owner, count: int) -> bool:
        """Write the hold count into the node of ``entry``, for the admin; False if the node is gone."""
        from kazoo.exceptions import NoNodeError

        try:
            self._request("set", entry[0], node_data(owner, count, entry[2]))
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
                present = self._show_count(entry, owner, left)
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
                raise session.unavailable(ConnectionError("the connection is suspended"))
            left = session.contact + session.timeout - time.monotonic()
            # Not past the moment the session may expire (kazoo may not have noticed a silent server yet).
            limit = min(self.connect_timeout, max(left, 0.5))
            if self._request("exists", entry[0], limit=limit) is not None:
                return True
            self._forget(key, owner)
            return False
        except Exception:  # unavailable, or any error: past the session timeout, nothing else gives the hold up
            if not session.may_have_expired():
                raise
        self.drop(key, owner)
        return False

    def proven_until(self, key: str, owner: Owner, lease_ends: float) -> float:
        """The moment the server may expire our session (and delete the node): ``timeout`` after it last heard from us.

        0 once the node is known gone (a session that was lost).
        """
        session = self._session()
        with session.lock:
            if (key, owner.secret) not in session.held:
                return 0.0
        return session.contact + session.timeout

    def record(self, key: str, value: str) -> str:
        """Keep ``value`` as the data of the persistent node of ``key`` (``distlocks_cleanup`` deletes it)."""
        from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

        node = self._parent(key)
        while True:
            try:
                self._request("create", node, value.encode(), acl=self._session().acl, makepath=True)
                return value
            except NodeExistsError:
                pass
            try:
                data, stat = self._request("get", node)
                if data:
                    return str(data.decode(errors="replace"))
                self._request("set", node, value.encode(), version=stat.version)
                return value
            except (NoNodeError, BadVersionError):
                continue  # deleted or written meanwhile: look again

    # -- inspection and maintenance (see inspection) -----------------------------

    def held(self) -> Iterator[LockInfo]:
        return self._inspection.held()

    def force_release(self, key: str, token: int | None = None) -> bool:
        return self._inspection.force_release(key, token)

    def clear_expired(self, dry_run: bool = False) -> int:
        return self._inspection.clear_expired(dry_run)

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
