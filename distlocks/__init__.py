"""distlocks: distributed locks for Django on the database, Redis, Redlock or ZooKeeper."""

from __future__ import annotations

from distlocks.exceptions import BackendUnavailable, LockError, LockLost, LockNotAcquired, LockNotOwned
from distlocks.lock import DistributedLock, lock

__all__ = [
    "BackendUnavailable",
    "DistributedLock",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "lock",
]
