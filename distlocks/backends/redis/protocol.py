"""``RedisBackend`` as the modules below it see it: its read-write sides, a task's turn, the async primitives.

A protocol, so that ``side.py``, ``aiowait.py`` and ``aio.py`` need not
import ``backend.py``, which imports them (the layout test forbids cycles).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from distlocks.backends.redis.handover import Waiter
    from distlocks.backends.redis.scripts import Attempt
    from distlocks.exceptions import BackendUnavailable
    from distlocks.owner import Owner


class QueuingBackend(Protocol):
    """What the backend's sides, a task's turn and the async primitives call on ``RedisBackend``."""

    alias: str
    cache: str
    wait_replicas: int
    wait_timeout: float

    @property
    def address(self) -> str: ...

    @property
    def server(self) -> tuple[str, str]: ...

    def new_loop_releases(self) -> Any: ...

    @property
    def client(self) -> Any: ...

    def unavailable(self, exc: Exception) -> BackendUnavailable: ...

    def inspected(self, policy: str | None) -> None: ...

    def call(self, script: str, keys: Sequence[str], args: list[Any], confirmed: bool = False) -> Any: ...

    def attempt(self, key: str, owner: Owner, ttl: float, waiter: Waiter | None) -> Attempt: ...

    def rw_attempt(self, key: str, owner: Owner, ttl: float, mode: str, waiter: Waiter | None) -> Attempt: ...

    def run(self, attempt: Attempt) -> int | None: ...

    def waiter(self, slot: str) -> Waiter | None: ...

    def wait_hint(self, slot: str) -> float: ...

    def begin_wait(self, key: str, lock_hash: str = "") -> None: ...

    def wait(self, key: str, attempt: int, remaining: float | None, lock_hash: str = "") -> None: ...

    def stop_waiting(self, slot: str, acquired: bool, abandon: str, keys: Sequence[str]) -> None: ...

    def leave_queue(self, key: str, waiter: Waiter, mode: str = "") -> None: ...
