"""One verifier process: ``python -m distlocks.verify.worker CONFIG_JSON``.

From when the parent says go until the deadline it gives, it takes the lock in
a loop and, inside, reads the counter, works, and writes the counter plus one
(a read-modify-write that only the lock protects). It tells the parent each
step as a JSON line on stdout: ``enter`` (the token, when ``acquire()`` was
called and returned), ``read`` and ``write`` (the race's window opens and
closes), ``exit`` (when the section ended, what the write and the release
did). The times are ``time.monotonic()``, one clock for every process of the
machine (CLOCK_MONOTONIC), so the parent can compare them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def section(config: dict[str, Any], counter: Any, write: Any, token: int) -> str:
    """Increment the counter by read-modify-write; return ``ok``, ``rejected`` or ``error: ...``."""
    from django.db import DatabaseError, connections, transaction

    from distlocks.exceptions import StaleToken

    database = config["database"]
    row = counter._default_manager.using(database).filter(pk=1)
    try:
        if config["fence"]:
            from distlocks.fencing import fenced_update

            # Stamp the row with our token before reading it: from then on an
            # older holder's write is refused, so what we read stays current.
            fenced_update(row, token)
        value = row.values_list("value", flat=True).get()
        emit("read")  # the window of the race opens: the verifier pauses holders here
        time.sleep(config["work"])
        emit("write")  # ... and closes: the write begins
        with transaction.atomic(using=database):
            # The counter first: its row lock orders the log's ids as the commits.
            if config["fence"]:
                fenced_update(row, token, value=value + 1)
            else:
                row.update(value=value + 1)
            write._default_manager.using(database).create(process=os.getpid(), token=token, value=value + 1)
    except StaleToken:  # the fence refused the write: a newer holder wrote the row
        return "rejected"
    except DatabaseError as exc:
        connections[database].close_if_unusable_or_obsolete()
        return f"error: {type(exc).__name__}: {exc}"
    return "ok"


def run(config: dict[str, Any]) -> None:
    import distlocks
    from distlocks.verify.tables import make_models

    counter, write = make_models(config["run"], fenced=config["fence"])
    lock = distlocks.lock(config["name"], using=config["alias"], ttl=config["ttl"], renew=config["renew"])
    emit("ready")
    line = sys.stdin.readline()  # the parent starts every process at once, with the run's deadline
    if not line:
        return
    deadline = float(line)
    while (called := time.monotonic()) < deadline:
        try:
            if not lock.acquire(wait=min(1.0, deadline - called)):
                continue
        except distlocks.LockError as exc:
            emit("error", at=time.monotonic(), error=f"{type(exc).__name__}: {exc}")
            time.sleep(0.1)
            continue
        start = time.monotonic()
        token = lock.token
        emit("enter", token=token, called=called, start=start)
        outcome = section(config, counter, write, token)
        end = time.monotonic()
        try:
            lock.release()
            released = "ok"
        except distlocks.LockLost:
            released = "lost"
        except distlocks.LockError as exc:
            released = f"error: {type(exc).__name__}"
        emit("exit", end=end, outcome=outcome, released=released)


def die_with(parent: int) -> None:
    """Be killed when the verifier dies, even stopped (Linux's PR_SET_PDEATHSIG; elsewhere the deadline ends us)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before we asked
        sys.exit(1)


def main(argument: str) -> None:
    config = json.loads(argument)
    die_with(config["parent"])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", config["settings"])
    import django
    from django.conf import settings

    django.setup()
    # The parent's database names (a test database, say), before any connection opens.
    for alias, name in config["databases"].items():
        settings.DATABASES[alias]["NAME"] = name
    with contextlib.suppress(BrokenPipeError):  # the parent is gone
        run(config)


if __name__ == "__main__":
    main(sys.argv[1])
