"""What operators see and do on ZooKeeper: the holders of every lock, force-release, reaping empty lock parents.

The admin and the commands only read and delete nodes: none of it takes part
in acquiring or holding a lock, so it lives apart from the backend's
primitives and needs nothing of theirs but a way to ask the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from distlocks.backends.base import LockInfo
from distlocks.backends.zookeeper.nodes import escape, parse_data, queue, rw_blockers, rw_queue, unescape


class Inspection:
    """The lock nodes under ``root``, as ``request`` (``ZooKeeperBackend._request``) reaches them."""

    def __init__(self, alias: str, root: str, request: Callable[..., Any]) -> None:
        self.alias = alias
        self.root = root
        self._request = request

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
                yield from (info for info, _ in self._rw_held(escaped))
                children = queue(self._request("get_children", parent))
                if not children:
                    continue
                data, stat = self._request("get", f"{parent}/{children[0]}")
            except NoNodeError:
                continue
            yield self._node_info(escaped, data, stat, len(children) - 1)

    def _node_info(self, escaped: str, data: bytes, stat: Any, waiters: int, kind: str = "lock") -> LockInfo:
        """A holder as its node under the parent ``escaped`` shows it (its data: see ``node_data``)."""
        holder, count, token = parse_data(data, stat)
        return LockInfo(
            alias=self.alias,
            key=unescape(escaped),
            owner=holder,
            hold_count=count,
            token=token,
            acquired_at=datetime.fromtimestamp(stat.ctime / 1000, timezone.utc),
            waiters=waiters,
            kind=kind,
        )

    def _rw_held(self, escaped: str) -> list[tuple[LockInfo, str]]:
        """The holders of the read-write lock under ``escaped``, each with its node's path."""
        from kazoo.exceptions import NoNodeError

        parent = f"{self.root}/{escaped}"
        children = rw_queue(self._request("get_children", parent))
        held = [child for child in children if not rw_blockers(children, child)]
        found = []
        for child in held:
            try:
                data, stat = self._request("get", f"{parent}/{child}")
            except NoNodeError:
                continue
            kind = "write" if child.startswith("write-") else "read"
            found.append((self._node_info(escaped, data, stat, len(children) - len(held), kind), f"{parent}/{child}"))
        return found

    def force_release(self, key: str, token: int | None = None) -> bool:
        """Delete the holder's node; with ``token``, only if that node's czxid is ``token``.

        A node's path names one acquisition (its sequence number is never
        reused), so checking its czxid and then deleting exactly that path
        never frees a later holder's lock.
        """
        from kazoo.exceptions import NoNodeError

        parent = f"{self.root}/{escape(key)}"
        try:
            children = queue(self._request("get_children", parent))
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

    def rw_force_release(self, key: str, token: int | None = None) -> bool:
        """Delete a holder's node: with ``token``, the one of that acquisition (a path names one acquisition)."""
        from kazoo.exceptions import NoNodeError

        try:
            held = self._rw_held(escape(key))
        except NoNodeError:
            return False
        for info, node in sorted(held, key=lambda found: found[0].kind != "write"):
            if token is None or info.token == token:
                try:
                    self._request("delete", node)
                except NoNodeError:
                    return False
                return True
        return False

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
