"""Fault injection: each test breaks something for real and checks what the lock guarantees.

One module per place the fault hits: ``test_core.py`` (signal receivers, the
watchdog, releases), ``test_interrupts.py`` (signal handlers that raise),
``test_kinds.py`` (semaphores, read-write locks), ``test_db.py``,
``test_native.py``, ``test_redis.py`` (``test_redis_replicas.py``: WAIT_REPLICAS), ``test_redlock.py`` and
``test_zookeeper.py``.
"""
