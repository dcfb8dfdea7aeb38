"""The history of a verifier run and its checks: pure functions over critical sections and writes.

The checks follow Jepsen's idea (Kyle Kingsbury, https://jepsen.io): record
what every client did on one clock, then check the whole history against
what the lock promises, instead of trusting any single observation.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Section:
    """One critical section of one process, on the machine's monotonic clock.

    ``called`` is when ``acquire()`` was called, ``start`` when it returned,
    ``end`` when the process left the section (or was killed). ``outcome`` is
    what its write did: ``ok`` (committed), ``rejected`` (the fence refused it),
    ``killed``, ``unfinished`` (the process ended inside), ``error: ...``;
    ``released`` what ``release()`` said: ``ok``, ``lost`` (LockLost) or ``-``.
    """

    process: int
    token: int
    called: float
    start: float
    end: float
    outcome: str = "ok"
    released: str = "ok"


@dataclass(frozen=True)
class Write:
    """An increment the database committed: ``value`` is what it set the counter to, ``seq`` its place in commit order."""

    seq: int
    process: int
    token: int
    value: int


@dataclass(frozen=True)
class Fault:
    """A fault injected into a process: ``kill`` (at ``start``) or ``pause`` (from ``start`` to ``end``)."""

    kind: str
    process: int
    start: float
    end: float


@dataclass(frozen=True)
class Violation:
    kind: str  # overlap, token_order, stale_write, lost_update
    detail: str


@dataclass
class History:
    """Everything a run recorded; ``origin`` is the clock's reading at the run's start."""

    sections: list[Section]
    writes: list[Write]
    initial: int
    final: int
    faults: list[Fault] = field(default_factory=list)
    origin: float = 0.0


def overlaps(sections: list[Section]) -> list[tuple[Section, Section]]:
    """Pairs of sections of different processes that were inside at the same time (earlier start first)."""
    found = []
    ordered = sorted(sections, key=lambda section: section.start)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            if second.start >= first.end:
                break
            if second.process != first.process:
                found.append((first, second))
    return found


def token_disorder(sections: list[Section]) -> list[tuple[Section, Section]]:
    """Pairs (earlier, later) where ``earlier`` had its lock before ``later`` asked, yet a token at least as large.

    "Before" is real-time order: ``earlier.start < later.called``. A process
    that was paused inside ``acquire()`` may learn of its token late; that is
    no violation, so only acquisitions known to be ordered are compared. One
    pair per offending section: the earlier section with the largest token.
    """
    by_start = sorted(sections, key=lambda section: section.start)
    starts = [section.start for section in by_start]
    # best[i]: the section with the largest token among by_start[: i + 1]
    best: list[Section] = []
    for section in by_start:
        best.append(section if not best or section.token > best[-1].token else best[-1])
    found = []
    for later in sections:
        known = bisect.bisect_left(starts, later.called)  # sections that started before `later` asked
        if known and best[known - 1].token >= later.token:
            found.append((best[known - 1], later))
    return sorted(found, key=lambda pair: pair[1].start)


def stale_writes(writes: list[Write]) -> list[tuple[Write, Write]]:
    """Pairs (newer, stale): ``stale`` was committed after ``newer`` although its token is smaller."""
    found = []
    newest: Write | None = None
    for write in sorted(writes, key=lambda write: write.seq):
        if newest is not None and write.token < newest.token:
            found.append((newest, write))
        if newest is None or write.token > newest.token:
            newest = write
    return found


def lost_updates(committed: int, initial: int, final: int) -> int:
    """Committed increments that the counter does not show (negative: the counter is ahead of them)."""
    return committed - (final - initial)


def clobbers(writes: list[Write], initial: int) -> list[tuple[Write | None, Write]]:
    """Pairs (previous, write) of consecutive commits where ``write`` did not add one to what ``previous`` left.

    Each is where updates were lost: ``write`` was computed from an older read.
    """
    found: list[tuple[Write | None, Write]] = []
    previous: Write | None = None
    for write in sorted(writes, key=lambda write: write.seq):
        if write.value != (previous.value if previous else initial) + 1:
            found.append((previous, write))
        previous = write
    return found


@dataclass
class Verdict:
    """What the checks found; ``violations`` is empty when the run is clean."""

    cycles: int
    overlaps: list[tuple[Section, Section]]
    token_order_violations: list[tuple[Section, Section]]
    stale_writes_accepted: list[tuple[Write, Write]]
    stale_writes_rejected: int
    lost_updates: int
    violations: list[Violation]

    def as_dict(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "violations": [asdict(violation) for violation in self.violations],
            "overlaps": len(self.overlaps),
            "token_order_violations": len(self.token_order_violations),
            "lost_updates": self.lost_updates,
            "stale_writes_rejected": self.stale_writes_rejected,
            "stale_writes_accepted": len(self.stale_writes_accepted),
        }


def check(history: History, *, fenced: bool = False) -> Verdict:
    """Check ``history``: every overlap, token out of order, stale write and lost update is a violation.

    With ``fenced`` (the writes went through the fence), an overlap is only
    reported: what matters is whether a stale write got through or an update
    was lost, and those stay violations.
    """

    def at(moment: float) -> str:
        return f"{moment - history.origin:.3f}s"

    def span(section: Section) -> str:
        return f"process {section.process} (token {section.token}, {at(section.start)}-{at(section.end)})"

    found_overlaps = overlaps(history.sections)
    disorder = token_disorder(history.sections)
    stale = stale_writes(history.writes)
    lost = lost_updates(len(history.writes), history.initial, history.final)
    violations = []
    if not fenced:
        # One line per section that others entered: a paused holder overlaps many.
        entered: dict[Section, list[Section]] = {}
        for first, second in found_overlaps:
            entered.setdefault(first, []).append(second)
        for first, others in entered.items():
            tokens = sorted(other.token for other in others)
            violations.append(
                Violation(
                    "overlap",
                    f"{span(first)} was still inside when {len(others)} section(s) of other processes ran "
                    f"(tokens {tokens[0]}-{tokens[-1]}, {at(min(o.start for o in others))}-{at(max(o.end for o in others))})",
                )
            )
    violations += [
        Violation("token_order", f"{span(b)} asked after {span(a)} had the lock, yet got a token not larger")
        for a, b in disorder
    ]
    violations += [
        Violation(
            "stale_write",
            f"process {old.process} wrote with token {old.token} after process {new.process} had written with {new.token}",
        )
        for new, old in stale
    ]
    if lost:
        where = [
            f"process {write.process} (token {write.token}) set it to {write.value} "
            f"when it was at {previous.value if previous else history.initial}"
            for previous, write in clobbers(history.writes, history.initial)
        ]
        violations.append(
            Violation(
                "lost_update",
                f"{len(history.writes)} increments were committed but the counter went from "
                f"{history.initial} to {history.final}" + (f": {'; '.join(where[:5])}" if where else ""),
            )
        )
    return Verdict(
        cycles=len(history.sections),
        overlaps=found_overlaps,
        token_order_violations=disorder,
        stale_writes_accepted=stale,
        stale_writes_rejected=sum(1 for section in history.sections if section.outcome == "rejected"),
        lost_updates=lost,
        violations=violations,
    )


def timeline(history: History) -> dict[str, list[dict[str, Any]]]:
    """The sections and faults of ``history`` as plain data, in seconds since the run's start (for --json)."""

    def shifted(event: Section | Fault) -> dict[str, Any]:
        data = asdict(event)
        for key in ("called", "start", "end"):
            if key in data:
                data[key] = round(data[key] - history.origin, 6)
        return data

    return {"sections": [shifted(s) for s in history.sections], "faults": [shifted(f) for f in history.faults]}
