"""The Redis backend's lock calls as coroutines on the event loop (``redis.asyncio``): ``alock()`` without a thread.

The same Lua scripts and attempts as a thread's (``RedisBackend.attempt``),
run on the loop's client of the server, which its hand-over reader also uses
(``aiowait.LoopReleases``): the cache's address, credentials, SSL and
timeouts, so a frozen server fails a call with BackendUnavailable within the
cache's SOCKET_TIMEOUT. The leases of async holds are renewed by the process's
watchdog, from its threads, on the sync client: a loop that stalls past the
lease keeps its locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

from distlocks.backends.base import AsyncTurn
from distlocks.backends.redis import replicas, strays
from distlocks.backends.redis.aiowait import RedisTurn, loop_releases
from distlocks.backends.redis.keys import keys_of_lock, keys_of_read_write_lock, lock_hash
from distlocks.backends.redis.protocol import QueuingBackend
from distlocks.backends.redis.scripts import Attempt, registered
from distlocks.backends.redis.server import inspected, lease_ms, policy_of
from distlocks.exceptions import BackendUnavailable
from distlocks.owner import Owner


class AsyncRedis:
    """``RedisBackend``'s lock primitives as coroutines (``AsyncPrimitives``), for one backend instance."""

    def __init__(self, backend: QueuingBackend) -> None:
        self.backend = backend
        self.server = backend.server

    def _loop_client(self) -> Any:
        """The running loop's ``LoopReleases`` (or a cluster's ``LoopShardReleases``): its ``client`` runs the scripts."""
        return loop_releases(self.server, self.backend.new_loop_releases)

    async def _call(self, script: str, keys: Sequence[str], args: list[Any], confirmed: bool = False) -> Any:
        """Run ``script`` on the loop's client; ``confirmed`` as ``RedisBackend.call``'s."""
        client = self._loop_client().client
        try:
            if self.server not in inspected:
                await self._inspect(client)
            backend = self.backend
            if confirmed and backend.wait_replicas and script in replicas.CONFIRMED:
                scripts = registered(client)
                return await replicas.acall(scripts[script], keys, args, backend.wait_replicas, backend.wait_timeout)
            return await registered(client)[script](keys=keys, args=args)
        except BaseException as exc:  # a cancelled task's too: its acquire may run yet, and is voided
            if strays.unanswered(exc, script, keys, args, lambda: self.backend.client):
                raise self.backend.unavailable(exc) from exc
            raise

    async def _inspect(self, client: Any) -> None:
        """The loop's look at the eviction policy, as ``RedisBackend._inspect`` (a connection error propagates)."""
        from redis.exceptions import ResponseError

        try:
            policy = policy_of(await client.config_get("maxmemory-policy"))
        except ResponseError:
            policy = None
        self.backend.inspected(policy)

    async def _run(self, attempt: Attempt) -> int | None:
        """Run an attempt's script calls on the loop; a call that raised is thrown into it."""
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                call = attempt.send(answer) if error is None else attempt.throw(error)
            except StopIteration as done:
                return done.value
            try:
                answer, error = await self._call(*call, confirmed=True), None
            except BaseException as exc:  # a cancelled task's too: the attempt may give back what it took
                error = exc

    async def try_acquire(self, key: str, owner: Owner, ttl: float, turn: AsyncTurn) -> int | None:
        redis_turn = cast(RedisTurn, turn)
        return redis_turn.attempted(self.backend, await self._run(redis_turn.attempt(self.backend, key, owner, ttl)))

    async def end_wait(self, turn: AsyncTurn, acquired: bool) -> None:
        redis_turn = cast(RedisTurn, turn)
        waiter = redis_turn.waiter
        if turn.end(acquired) is None or waiter is None:
            return
        keys = keys_of_read_write_lock(redis_turn.key) if redis_turn.mode else keys_of_lock(redis_turn.key)
        with contextlib.suppress(BackendUnavailable):
            await self._call("rw_abandon" if redis_turn.mode else "abandon", keys, [waiter.id, waiter.entry])

    async def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(await self._call("reenter", [lock_hash(key)], [owner.secret, lease_ms(ttl)]))

    async def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return bool(await self._call("reenter", [lock_hash(key)], [owner.secret, lease_ms(ttl), token]))

    async def release(self, key: str, owner: Owner) -> bool:
        return int(await self._call("release", keys_of_lock(key), [owner.secret])) >= 0

    async def release_token(self, key: str, owner: Owner, token: int) -> bool:
        return int(await self._call("release", keys_of_lock(key), [owner.secret, token])) >= 0


class AsyncRedisSide(AsyncRedis):
    """A read-write lock's side (``RedisSide``) as coroutines: its scripts on the same loop's client.

    Its attempts and their end are the lock's (a side's turn names its mode);
    re-entry and release are the side's scripts on the read-write lock's keys.
    """

    def __init__(self, backend: QueuingBackend, mode: str, lock_key: Callable[[str], str]) -> None:
        super().__init__(backend)
        self.mode = mode
        self.lock_key = lock_key  # the read-write lock's key of a side's key

    async def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        keys = keys_of_read_write_lock(self.lock_key(key))
        return bool(await self._call("rw_renew", keys, [owner.secret, lease_ms(ttl), self.mode, 1]))

    async def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        keys = keys_of_read_write_lock(self.lock_key(key))
        return bool(await self._call("rw_renew", keys, [owner.secret, lease_ms(ttl), self.mode, 1, token]))

    async def release(self, key: str, owner: Owner) -> bool:
        keys = keys_of_read_write_lock(self.lock_key(key))
        return int(await self._call("rw_release", keys, [owner.secret, self.mode])) >= 0

    async def release_token(self, key: str, owner: Owner, token: int) -> bool:
        keys = keys_of_read_write_lock(self.lock_key(key))
        return int(await self._call("rw_release", keys, [owner.secret, self.mode, token])) >= 0
