"""A ZooKeeper read-write lock's side: queued nodes under the lock's parent, and a token per acquisition."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from distlocks.backends.base import AsyncTurn
from distlocks.backends.sides import ReadWriteSide
from distlocks.backends.zookeeper.inspection import Inspection
from distlocks.backends.zookeeper.nodes import new_rw_mark, node_data, rw_blockers, rw_queue
from distlocks.backends.zookeeper.session import FollowUp, Session
from distlocks.backends.zookeeper.turn import ZooKeeperTurn
from distlocks.owner import Owner


class _Backend(Protocol):
    """What a side uses of its ``ZooKeeperBackend`` (the backend module imports this one)."""

    _queued: dict[str, tuple[str, int]]
    _listed: dict[str, list[str]]
    _inspection: Inspection

    def _session(self) -> Session: ...
    def _request(self, operation: str, *args: Any, limit: float | None = None, **kwargs: Any) -> Any: ...
    def _children(self, listing: FollowUp | None, node: str, parent: str, **kwargs: Any) -> Any: ...
    def _parent(self, key: str) -> str: ...
    def _create(
        self, key: str, owner: Owner, mark: str | None = None, then: FollowUp | None = None
    ) -> tuple[str, int]: ...
    def _begin_attempt(self) -> None: ...
    def _wait_for(self, remaining: float | None) -> None: ...
    def _wait_gone(self, node: str, remaining: float | None) -> None: ...
    def _last_ahead(self, key: str, parent: str, ahead: Callable[[list[str], str], list[str]]) -> str | None: ...
    def begin_wait(self, key: str) -> None: ...
    def end_wait(self, key: str, acquired: bool) -> None: ...
    def reenter(self, key: str, owner: Owner, ttl: float) -> bool: ...
    def release(self, key: str, owner: Owner) -> bool: ...
    def extend(self, key: str, owner: Owner, ttl: float) -> bool: ...
    def drop(self, key: str, owner: Owner) -> bool: ...


class ZooKeeperSide(ReadWriteSide):
    """A read-write lock's side: kazoo's ReadLock/WriteLock recipe (see ``ReadWriteSide``).

    Under the lock's parent node each acquire queues an ephemeral sequential
    node, "read-..." or "write-...". A reader holds the lock once no writer is
    queued before it, a writer once no node is: so a writer that queued
    blocks the readers that come after it. The write holder's reads queue as
    "downgrade-...", held at once, and later writers wait for them too. A
    thread's hold of one side is kept, as the lock's, under "<key>#<mode>".
    A task's node stays queued between its attempts too (``ZooKeeperTurn``).

    Tokens: unlike the lock's queue, this one is not served in the order its
    nodes were created (a downgrade passes a queued writer; readers waiting
    for one writer are let in together, in any order), so a node's creation
    zxid alone would not grow with the order of the acquisitions. An
    acquisition's token is its node's creation zxid only when nothing else
    happened under the lock since (its node is the only one, and the
    parent's last child change, ``pzxid``, is its creation); otherwise it
    writes its node once more when it is let in, and the zxid of that write,
    made after every acquisition that came before it, is its token (kept in
    the node's data for the admin).
    """

    backend: _Backend  # type: ignore[assignment]  # a ZooKeeperBackend

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        zk, lock, mode = self.backend, self.lock_key(key), self.mode
        session = zk._session()
        zk._begin_attempt()
        zk._listed.pop(key, None)
        listing = None
        if key not in zk._queued:
            with session.lock:
                writing = mode == "read" and (f"{lock}#write", owner.secret) in session.held
            listing = FollowUp("get_children", zk._parent(lock), include_data=True)
            zk._queued[key] = zk._create(lock, owner, new_rw_mark("downgrade" if writing else mode), then=listing)
        node, token = zk._queued[key]
        children, parent = zk._children(listing, node, zk._parent(lock), include_data=True)
        mine = node.rsplit("/", 1)[1]
        if mine not in children:
            # Gone with a lost session: queue again, at the back.
            node, token = zk._queued[key] = zk._create(lock, owner, new_rw_mark(mine.partition("-")[0]))
            mine = node.rsplit("/", 1)[1]
            children, parent = zk._request("get_children", zk._parent(lock), include_data=True)
        children = rw_queue(children)
        if rw_blockers(children, mine):
            zk._listed[key] = children
            return None
        shown = ""
        if children != [mine] or int(parent.pzxid) != token:
            fresh = self._fresh_token(node, owner)
            if fresh is None:
                return None  # gone meanwhile (force-released, a lost session): the next attempt queues again
            token, shown = fresh, f"t{fresh}"
        del zk._queued[key]
        with session.lock:
            session.held[key, owner.secret] = [node, 1, shown]
        return token

    def _fresh_token(self, node: str, owner: Owner) -> int | None:
        """Write our node once more: the zxid of that write, larger than every earlier token; None if it is gone."""
        from kazoo.exceptions import NoNodeError

        try:
            # "t" alone: the token is the zxid of the write that put it there (see node_data).
            stat = self.backend._request("set", node, node_data(owner, 1, "t"))
        except NoNodeError:
            return None
        return int(stat.mzxid)

    def begin_wait(self, key: str) -> None:
        """Start the acquire's time (nothing to record: a writer's queued node keeps later readers waiting)."""
        self.backend.begin_wait(key)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Wait for the deletion of the last node that keeps ours waiting (at most ``remaining`` seconds)."""
        self.backend._wait_for(remaining)
        blocker = self.blocker(key)
        if blocker is not None:
            self.backend._wait_gone(blocker, remaining)

    def blocker(self, key: str) -> str | None:
        """The last node that keeps our queued node waiting, to watch; None: try again now."""
        zk = self.backend
        return zk._last_ahead(
            key, zk._parent(self.lock_key(key)), lambda nodes, mine: rw_blockers(rw_queue(nodes), mine)
        )

    def async_turn(self, key: str) -> AsyncTurn:
        return ZooKeeperTurn(key)

    def end_wait(self, key: str, acquired: bool) -> None:
        self.backend.end_wait(key, acquired)

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.backend.reenter(key, owner, ttl)

    def release(self, key: str, owner: Owner) -> bool:
        return self.backend.release(key, owner)

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self.backend.extend(key, owner, ttl)

    def drop(self, key: str, owner: Owner) -> bool:
        return self.backend.drop(key, owner)

    def force_release(self, key: str, token: int | None = None) -> bool:
        return self.backend._inspection.rw_force_release(self.lock_key(key), token)
