"""distlocks: distributed locks for Django on the database, Redis, Redlock or ZooKeeper."""

from __future__ import annotations

from distlocks.aio import AsyncDistributedLock, alock
from distlocks.aiokinds import (
    AsyncMultiLock,
    AsyncReadWriteLock,
    AsyncSemaphore,
    amulti_lock,
    aread_write_lock,
    asemaphore,
)
from distlocks.election import Election, Term, election
from distlocks.exceptions import (
    BackendUnavailable,
    LeadershipLost,
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    StaleToken,
    SyncLockInAsyncContext,
)
from distlocks.lock import DistributedLock, lock
from distlocks.multi import MultiLock, multi_lock
from distlocks.rwlock import ReadWriteLock, read_write_lock
from distlocks.semaphore import Semaphore, semaphore

#: The release, as ``pip show distlocks`` and the commands' ``--version`` give it.
__version__ = "0.1.0"

__all__ = [
    "AsyncDistributedLock",
    "AsyncMultiLock",
    "AsyncReadWriteLock",
    "AsyncSemaphore",
    "BackendUnavailable",
    "DistributedLock",
    "Election",
    "LeadershipLost",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "MultiLock",
    "ReadWriteLock",
    "Semaphore",
    "StaleToken",
    "SyncLockInAsyncContext",
    "Term",
    "alock",
    "amulti_lock",
    "aread_write_lock",
    "asemaphore",
    "election",
    "lock",
    "multi_lock",
    "read_write_lock",
    "semaphore",
]
