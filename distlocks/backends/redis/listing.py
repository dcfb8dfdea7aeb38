"""What the Redis backend shows the admin and the cleanup command: the locks held, and unused fencing counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from distlocks.backends.base import LockInfo
from distlocks.backends.redis.keys import RW_SUFFIX, key_of


def rw_held(client: Any, alias: str) -> Iterator[LockInfo]:
    """The read-write locks held, one LockInfo per holder (a writer, or each reader)."""
    for raw in client.scan_iter(match=f"distlocks:{{*}}{RW_SUFFIX}", count=500):
        rw_hash = raw.decode() if isinstance(raw, bytes) else raw
        fields = {k.decode(): v.decode() for k, v in client.hgetall(rw_hash).items()}
        now = datetime.now(timezone.utc)
        clock = time.time() * 1000
        waiting = sum(1 for field, ends in fields.items() if field.startswith("q:") and int(ends) > clock)
        holds: list[tuple[str, int, int, int, str]] = []
        if "w" in fields and int(fields["we"]) > clock:
            holds.append(("write", int(fields["we"]), int(fields["wc"]), int(fields["wt"]), fields["wi"]))
        for field, entry in fields.items():
            if field.startswith("r:"):
                ends, count, token, info = entry.split(" ", 3)
                if int(ends) > clock:
                    holds.append(("read", int(ends), int(count), int(token), info))
        for mode, ends, count, token, info in holds:
            acquired, _, owner = info.partition(" ")
            yield LockInfo(
                alias=alias,
                key=key_of(rw_hash[: -len(RW_SUFFIX)]),
                owner=owner,
                hold_count=count,
                token=token,
                acquired_at=datetime.fromtimestamp(int(acquired), timezone.utc) if acquired.isdigit() else None,
                expires_at=now + timedelta(milliseconds=ends - clock),
                waiters=waiting,
                kind=mode,
            )


def held(client: Any, alias: str) -> Iterator[LockInfo]:
    """The locks held."""
    for raw in client.scan_iter(match="distlocks:{*}", count=500):
        info = lock_info(client, alias, raw.decode() if isinstance(raw, bytes) else raw)
        if info is not None:
            yield info


def lock_info(client: Any, alias: str, name: str) -> LockInfo | None:
    """The lock whose hash is ``name``, if it is held (one round trip)."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(name)
    pipe.pttl(name)
    fields, lease_ms = pipe.execute()
    if not fields or lease_ms < 0:
        return None
    fields = {k.decode(): v.decode() for k, v in fields.items()}
    acquired, _, owner = fields.get("info", "").partition(" ")
    return LockInfo(
        alias=alias,
        key=key_of(name),
        owner=owner,
        hold_count=int(fields.get("count", 0)),
        token=int(fields["token"]) if "token" in fields else None,
        acquired_at=datetime.fromtimestamp(int(acquired), timezone.utc) if acquired.isdigit() else None,
        expires_at=datetime.now(timezone.utc) + timedelta(milliseconds=lease_ms),
    )


def clear_unused_counters(client: Any, dry_run: bool) -> int:
    """Delete (unless ``dry_run``) the fencing counters of locks not held; return how many."""
    stale = []
    # A lock's counter, and a read-write lock's (its hash's name ends in ":rw").
    for pattern in ("distlocks:{*}:fence", "distlocks:{*}:rw:fence"):
        for raw in client.scan_iter(match=pattern, count=500):
            fence = raw.decode() if isinstance(raw, bytes) else raw
            if not client.exists(fence[: -len(":fence")]):
                stale.append(fence)
    if stale and not dry_run:
        client.delete(*stale)
    return len(stale)
