"""Signals sent by distlocks: lock_acquired, lock_released, lock_lost, lock_acquire_failed.

Every signal is sent with ``sender=DistributedLock`` and the keyword arguments
``name`` and ``alias``; besides:

- ``lock_acquired``: ``token``, and ``waited`` (seconds spent in ``acquire()``);
- ``lock_released``: ``token``, and ``held`` (seconds from acquiring to the last release);
- ``lock_lost``: ``token``;
- ``lock_acquire_failed``: ``waited``, and ``error``: None if the lock was not
  acquired within ``wait``, else the exception that ``acquire()`` raises
  (``BackendUnavailable``, ...).

Only a thread's first acquisition and last release are sent, not re-entries.
Durations come from ``time.monotonic()``.
"""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_acquire_failed = Signal()
