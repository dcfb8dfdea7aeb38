"""A read-write lock's side on Redis: ``RedisSide``, what ``RedisBackend.read_write_side`` returns.

It sits below ``redis/backend.py`` (which names it in ``side_class``) and
knows the backend only by the ``QueuingBackend`` protocol: no import cycle.
"""

from __future__ import annotations

from typing import Any, cast

from distlocks.backends.base import AsyncPrimitives, AsyncTurn, BaseLockBackend
from distlocks.backends.redis.keys import keys_of_read_write_lock
from distlocks.backends.redis.protocol import QueuingBackend
from distlocks.backends.redis.server import lease_ms
from distlocks.backends.sides import ReadWriteSide
from distlocks.owner import Owner


class RedisSide(ReadWriteSide):
    """A read-write lock's side: a hash of its holders and a queue (see ``ReadWriteSide`` and ``rwscripts``).

    Its waiters queue as a lock's do (``RedisBackend.wait``), in the read-write
    lock's queue, whose hash's name is their slot there.
    """

    def __init__(self, backend: BaseLockBackend, mode: str) -> None:  # noqa: D107
        super().__init__(backend, mode)
        self.redis = cast(QueuingBackend, backend)
        self._async_primitives: AsyncPrimitives | None = None

    def _keys(self, key: str) -> tuple[str, str, str]:
        return keys_of_read_write_lock(self.lock_key(key))

    def _call(self, script: str, key: str, args: list[Any]) -> Any:
        return self.redis.call(script, self._keys(key), args)

    def try_acquire(self, key: str, owner: Owner, ttl: float) -> int | None:
        redis = self.redis
        waiter = redis.waiter(self._keys(key)[0])
        return redis.run(redis.rw_attempt(self.lock_key(key), owner, ttl, self.mode, waiter))

    def begin_wait(self, key: str) -> None:
        rw_hash = self._keys(key)[0]
        self.redis.begin_wait(rw_hash, rw_hash)

    def wait(self, key: str, attempt: int, remaining: float | None) -> None:
        rw_hash = self._keys(key)[0]
        self.redis.wait(rw_hash, attempt, remaining, rw_hash)

    def end_wait(self, key: str, acquired: bool) -> None:
        keys = self._keys(key)
        self.redis.stop_waiting(keys[0], acquired, "rw_abandon", keys)

    def async_turn(self, key: str) -> AsyncTurn:
        from distlocks.backends.redis.aiowait import RedisTurn

        return RedisTurn(self.redis, self.lock_key(key), self.mode)

    def async_primitives(self) -> AsyncPrimitives:
        """The side's scripts as coroutines on the event loop's ``redis.asyncio`` client (see ``redis.aio``)."""
        primitives = self._async_primitives
        if primitives is None:
            from distlocks.backends.redis.aio import AsyncRedisSide

            primitives = self._async_primitives = AsyncRedisSide(self.redis, self.mode, self.lock_key)
        return primitives

    # The ``*_token`` forms name the acquisition too (see ``BaseLockBackend.release_token``).

    def reenter(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("rw_renew", key, [owner.secret, lease_ms(ttl), self.mode, 1]))

    def reenter_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return bool(self._call("rw_renew", key, [owner.secret, lease_ms(ttl), self.mode, 1, token]))

    def extend(self, key: str, owner: Owner, ttl: float) -> bool:
        return bool(self._call("rw_renew", key, [owner.secret, lease_ms(ttl), self.mode, 0]))

    def extend_token(self, key: str, owner: Owner, ttl: float, token: int) -> bool:
        return bool(self._call("rw_renew", key, [owner.secret, lease_ms(ttl), self.mode, 0, token]))

    def release(self, key: str, owner: Owner) -> bool:
        return int(self._call("rw_release", key, [owner.secret, self.mode])) >= 0

    def release_token(self, key: str, owner: Owner, token: int) -> bool:
        return int(self._call("rw_release", key, [owner.secret, self.mode, token])) >= 0

    def force_release(self, key: str, token: int | None = None) -> bool:
        return bool(self._call("rw_force_release", key, ["" if token is None else str(token)]))
