"""Redlock: one lock over N independent Redis servers (seed 004, antirez's algorithm).

Guarantees: a lock is held when the Redis backend's acquire script succeeded
on a majority of the nodes (``N // 2 + 1``) within the lease, less the time the
attempt took and a clock drift allowance (1 % of the lease + 2 ms); otherwise
whatever was taken is released on every node and the attempt failed. Renewal,
re-entry and release also need a majority. So the lock survives a minority of
nodes being down or restarted empty; with a majority down nothing can be
acquired: ``LockNotAcquired`` after ``wait``, or ``BackendUnavailable`` when not
even a majority of nodes answers.

What Redlock does *not* give (Kleppmann, "How to do distributed locking", and
antirez's reply "Is Redlock safe?"): its safety assumes bounded clock drift and
process pauses shorter than the lease; a node that restarts without persistence
can let a second client in, unless it stays down for a lease. Its fencing token
is the largest of the nodes' counters that took part: it grows as long as a
majority of those nodes keep their counters, and every counter restarts from
its server's clock in microseconds, but two nodes' clocks are not one counter,
so it is **not** a strict fencing token across node restarts. Where stale
writes must be refused, use the database or ZooKeeper backend's tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.backends.base import BaseLockBackend, LockInfo
from distlocks.backends.redis import RedisBackend
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner

T = TypeVar("T")


class RedlockBackend(BaseLockBackend):
    """A lock held on a majority of independent Redis servers (django-redis cache aliases)."""

    max_key_length = RedisBackend.max_key_length
    cleanup_noun = RedisBackend.cleanup_noun

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        caches = self.options.get("CACHES")
        if not isinstance(caches, list | tuple) or len(caches) < 1 or not all(isinstance(c, str) for c in caches):
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}]['OPTIONS']['CACHES'] must be a list of django-redis cache aliases"
            )
        if len(set(caches)) != len(caches):
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]['OPTIONS']['CACHES'] names a cache twice")
        # The nodes are Redis backends of their own: same scripts, same keys.
        self.nodes = [RedisBackend(f"{alias}[{cache}]", {"OPTIONS": {"CACHE": cache}}) for cache in caches]
        self.quorum = len(self.nodes) // 2 + 1

    def _on_each(self, call: Callable[[RedisBackend], T]) -> list[T | None]:
        """Run ``call`` on every node; None where the node did not answer."""
        results: list[T | None] = []
        for node in self.nodes:
            try:
                results.append(call(node))
            except BackendUnavailable:
                results.append(None)
        return results

    def _answered(self, results: list[Any]) -> None:
        answered = sum(result is not None for result in results)
        if answered < self.quorum:
            raise BackendUnavailable(
                f"Redlock {self.alias!r}: only {answered} of {len(self.nodes)} Redis nodes answer, "
                f"{self.quorum} are needed",
                alias=self.alias,
            )

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        started = time.monotonic()
        tokens = self._on_each(lambda node: node.try_acquire(key, owner, ttl) or 0)
        elapsed = time.monotonic() - started
        validity = ttl - elapsed - (ttl * 0.01 + 0.002)
        won = [token for token in tokens if token]
        if len(won) >= self.quorum and validity > 0:
            return max(won)
        # Not a majority in time: undo what was taken, everywhere.
        self._on_each(lambda node: node.release(key, owner))
        self._answered(tokens)
        return None

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._majority(lambda node: node.reenter(key, owner, ttl))

    def release(self, key: str, owner: Owner) -> bool:
        return self._majority(lambda node: node.release(key, owner))

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return self._majority(lambda node: node.extend(key, owner, ttl))

    def _majority(self, call: Callable[[RedisBackend], bool]) -> bool:
        results = self._on_each(call)
        self._answered(results)
        return sum(bool(result) for result in results) >= self.quorum

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        """Sleep a random while before the next attempt, so that clients do not retry in lockstep."""
        delay = random.uniform(0.002, min(0.005 * 2 ** min(attempt, 4), 0.05))
        time.sleep(delay if remaining is None else min(delay, remaining))

    def held(self) -> Iterator[LockInfo]:
        seen: dict[str, list[LockInfo]] = {}
        for node in self.nodes:
            try:
                for info in node.held():
                    seen.setdefault(info.name, []).append(info)
            except Exception:  # a node that is down shows nothing
                continue
        for infos in seen.values():
            if len(infos) >= self.quorum:
                first = infos[0]
                yield LockInfo(
                    alias=self.alias,
                    name=first.name,
                    owner=first.owner,
                    hold_count=first.hold_count,
                    token=max(info.token or 0 for info in infos),
                    acquired_at=first.acquired_at,
                    expires_at=min(info.expires_at for info in infos if info.expires_at),
                )

    def force_release(self, key: str) -> bool:
        return any(self._on_each(lambda node: node.force_release(key)))

    def clear_expired(self, dry_run: bool = False) -> int:
        return sum(count or 0 for count in self._on_each(lambda node: node.clear_expired(dry_run)))

    @property
    def address(self) -> str:
        return ", ".join(node.address for node in self.nodes)

    def ping(self) -> None:
        """Raise BackendUnavailable if any node does not answer: with a majority left it still works, degraded."""

        def answers(node: RedisBackend) -> bool:
            node.ping()
            return True

        answered = self._on_each(answers)
        down = [node.address for node, answer in zip(self.nodes, answered, strict=True) if answer is None]
        if down:
            raise BackendUnavailable(
                f"Redlock {self.alias!r}: {len(down)} of {len(self.nodes)} Redis nodes do not answer ({', '.join(down)}); "
                f"{self.quorum} are needed to lock",
                alias=self.alias,
            )

    def check(self) -> list[checks.CheckMessage]:
        messages = [message for node in self.nodes for message in node.check()]
        if len(self.nodes) < 3:
            messages.append(
                checks.Warning(
                    f"DISTLOCKS[{self.alias!r}] runs Redlock on {len(self.nodes)} node(s): it survives no failure.",
                    hint="Use 3 or 5 independent Redis servers.",
                    id="distlocks.W003",
                )
            )
        return messages
