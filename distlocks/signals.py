"""Signals sent by distlocks: lock_acquired, lock_released, lock_lost.

Every signal is sent with ``sender=DistributedLock`` and the keyword arguments
``name``, ``alias`` and ``token``.
"""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
