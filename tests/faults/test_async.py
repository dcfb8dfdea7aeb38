"""``alock()`` under faults: a task cancelled while its attempt hangs on a frozen server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import distlocks
from tests.servers import REDIS_PORT

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_task_cancelled_while_its_attempt_hangs_leaves_no_lock_once_the_server_answers(own_redis, name):
    """The attempt goes on in the pool after the cancel; when it ends holding the lock, the lock is released."""
    server = own_redis(REDIS_PORT + 90, SOCKET_CONNECT_TIMEOUT=2, SOCKET_TIMEOUT=10)
    lk = distlocks.alock(name, using="own", ttl=60)

    async def main():
        assert await lk.acquire(wait=0)  # a connection is open: the frozen server's kernel takes the request
        await lk.release()
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            attempt = asyncio.create_task(lk.acquire(wait=30))
            await asyncio.sleep(0.5)  # its first attempt is waiting for the frozen server's answer
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20  # far less than the 60 s lease
        while (holder := await asyncio.to_thread(lk.lock.holder)) is not None:
            assert time.monotonic() < deadline, f"the cancelled task's attempt left the lock held: {holder}"
            await asyncio.sleep(0.05)
        assert lk.hold_count == 0

    asyncio.run(main())
