"""The last half hour of each alias's acquires, waits and losses, per minute, for the admin's held-locks page.

These are the figures of the process that serves the page; Prometheus adds up
every process's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

MINUTES = 30
#: The chart's size in pixels: one bar per minute.
BAR_WIDTH, BAR_GAP, CHART_HEIGHT = 6, 2, 32


@dataclass
class Minute:
    start: int  # time.time() // 60
    acquired: int = 0
    longest_wait: float = 0.0
    timeouts: int = 0
    errors: int = 0
    lost: int = 0


@dataclass(frozen=True)
class Bar:
    x: int
    y: float
    height: float
    minutes_ago: int
    minute: Minute


@dataclass(frozen=True)
class Chart:
    """One alias's last ``MINUTES`` minutes: a bar per minute as high as its longest wait."""

    alias: str
    bars: list[Bar]
    longest_wait: float
    acquired: int
    timeouts: int
    errors: int
    lost: int
    width: int = MINUTES * (BAR_WIDTH + BAR_GAP)
    height: int = CHART_HEIGHT
    bar_width: int = BAR_WIDTH


_lock = threading.Lock()
_minutes: dict[str, deque[Minute]] = {}


def _now(alias: str) -> Minute:
    """This minute's figures of ``alias``; the caller holds ``_lock``."""
    start = int(time.time() // 60)
    minutes = _minutes.setdefault(alias, deque(maxlen=MINUTES))
    if not minutes or minutes[-1].start != start:
        minutes.append(Minute(start))
    return minutes[-1]


def note_acquired(alias: str, waited: float) -> None:
    with _lock:
        minute = _now(alias)
        minute.acquired += 1
        minute.longest_wait = max(minute.longest_wait, waited)


def note_failed(alias: str, error: Exception | None) -> None:
    with _lock:
        minute = _now(alias)
        if error is None:
            minute.timeouts += 1
        else:
            minute.errors += 1


def note_lost(alias: str) -> None:
    with _lock:
        _now(alias).lost += 1


def charts() -> list[Chart]:
    """Return a chart for every alias with figures in the last ``MINUTES`` minutes, by alias."""
    now = int(time.time() // 60)
    with _lock:
        recent = {
            alias: {m.start: Minute(**vars(m)) for m in minutes if now - m.start < MINUTES}
            for alias, minutes in _minutes.items()
        }
    found = []
    for alias, by_start in sorted(recent.items()):
        if not by_start:
            continue
        minutes = list(by_start.values())
        longest = max(m.longest_wait for m in minutes)
        bars = []
        for ago in range(MINUTES - 1, -1, -1):
            minute = by_start.get(now - ago) or Minute(now - ago)
            height = max(1.0, CHART_HEIGHT * minute.longest_wait / longest) if minute.longest_wait else 0.0
            x = (MINUTES - 1 - ago) * (BAR_WIDTH + BAR_GAP)
            bars.append(Bar(x, CHART_HEIGHT - height, height, ago, minute))
        found.append(
            Chart(
                alias,
                bars,
                longest,
                acquired=sum(m.acquired for m in minutes),
                timeouts=sum(m.timeouts for m in minutes),
                errors=sum(m.errors for m in minutes),
                lost=sum(m.lost for m in minutes),
            )
        )
    return found
