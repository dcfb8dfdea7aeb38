"""Check a configured lock backend under faults: overlaps, token order, lost updates, stale writes."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from distlocks.backends.locmem import LocMemBackend
from distlocks.exceptions import LockError
from distlocks.handler import locks
from distlocks.management.base import DistlocksCommand
from distlocks.verify.history import Verdict, check, timeline
from distlocks.verify.runner import FAULTS, Outcome, Plan, VerifyError, run

SHOWN = 20  # violations listed on the terminal; --json has them all


def _faults(value: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(kind.strip() for kind in value.split(",") if kind.strip()))
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown:
        raise CommandError(f"--faults: unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    return kinds


class Command(DistlocksCommand):
    help = (
        "Run processes that take one lock in a loop and increment a counter under it, inject faults "
        "into them, and check the history; exit 1 if a violation was found."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--using", required=True, help="The DISTLOCKS alias to check.")
        parser.add_argument("--processes", type=int, default=4, help="Processes taking the lock (default 4).")
        parser.add_argument("--seconds", type=float, default=20.0, help="How long they run (default 20).")
        parser.add_argument("--ttl", type=float, help="The lock's lease in seconds (default: the alias's TTL).")
        parser.add_argument("--no-renew", dest="renew", action="store_false", help="Do not renew leases.")
        parser.add_argument("--faults", default="", help=f"Comma-separated, from: {', '.join(FAULTS)}.")
        parser.add_argument(
            "--fence", action="store_true", help="Write through distlocks.fencing (the row checks the token)."
        )
        parser.add_argument("--database", default="default", help="Where the counter lives (default 'default').")
        parser.add_argument("--json", dest="json_path", help="Write the results as JSON to this path.")
        parser.add_argument("--plot", dest="plot_path", help="Draw the timeline as a PNG to this path.")

    def handle(self, *args: Any, **options: Any) -> None:
        plan = self._plan(options)
        if options["plot_path"]:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise CommandError("--plot needs matplotlib: pip install 'distlocks[plot]'") from None
        try:
            from rich.console import Console
        except ImportError:
            raise CommandError("distlocks_verify needs rich: pip install 'distlocks[verify]'") from None
        try:
            outcome = self._run(plan, Console(file=_stream(self.stderr)))
        except (VerifyError, LockError) as exc:
            raise CommandError(str(exc)) from exc
        except DatabaseError as exc:
            raise CommandError(f"--database {plan.database!r}: {exc}") from exc
        history = outcome.history
        if not history.sections:
            raise CommandError(
                f"no process ever held the lock on {plan.alias!r}: nothing was verified. "
                + "; ".join(outcome.notes or ["no error was reported"])
            )
        verdict = check(history, fenced=plan.fence)
        if options["json_path"]:
            result = {"alias": plan.alias, **verdict.as_dict(), **self._facts(plan, outcome)}
            Path(options["json_path"]).write_text(json.dumps(result, indent=2) + "\n")
        if options["plot_path"]:
            from distlocks.verify.plot import draw

            title = f"distlocks_verify --using {plan.alias}: {verdict.cycles} sections, {len(verdict.violations)} violations"
            draw(history, verdict, options["plot_path"], title)
        Console(file=_stream(self.stdout), width=120).print(self._table(plan, outcome, verdict))
        self._report(verdict, outcome)
        if verdict.violations:
            raise CommandError(f"{len(verdict.violations)} violation(s) found on {plan.alias!r}")

    def _plan(self, options: dict[str, Any]) -> Plan:
        alias = options["using"]
        if alias not in getattr(settings, "DISTLOCKS", {"default": None}):
            raise CommandError(f"--using: {alias!r} is not an alias of DISTLOCKS")
        try:
            backend = locks[alias]
        except ImproperlyConfigured as exc:
            raise CommandError(f"--using: {exc}") from exc
        if isinstance(backend, LocMemBackend):
            raise CommandError(f"--using: {alias!r} keeps its locks in one process (LocMemBackend): nothing to verify")
        if options["database"] not in settings.DATABASES:
            raise CommandError(f"--database: {options['database']!r} is not an alias of DATABASES")
        if options["processes"] < 2:
            raise CommandError("--processes must be at least 2: one process alone cannot race")
        if not options["seconds"] > 0:
            raise CommandError("--seconds must be a positive number of seconds")
        if options["ttl"] is not None and not options["ttl"] > 0:
            raise CommandError("--ttl must be a positive number of seconds")
        faults = _faults(options["faults"])
        if faults and not hasattr(signal, "SIGSTOP"):
            raise CommandError("--faults needs POSIX signals (SIGKILL, SIGSTOP)")
        plan = Plan(
            alias=alias,
            processes=options["processes"],
            seconds=options["seconds"],
            ttl=options["ttl"],
            renew=options["renew"],
            faults=faults,
            database=options["database"],
            fence=options["fence"],
        )
        if "pause" in faults and plan.seconds < plan.lease + 2:
            raise CommandError(
                f"--seconds: a pause must outlast the lease ({plan.lease:g}s) within the run: "
                f"give more than {plan.lease + 2:g} seconds, or a shorter --ttl"
            )
        return plan

    def _run(self, plan: Plan, console: Any) -> Outcome:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with (
            _exit_on_sigterm(),
            Progress(
                TextColumn(f"verifying {plan.alias}"),
                BarColumn(),
                TextColumn("{task.fields[cycles]} sections, {task.fields[faults]} faults"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress,
        ):
            task = progress.add_task("run", total=plan.seconds, cycles=0, faults=0)
            return run(
                plan,
                lambda elapsed, cycles, faults: progress.update(task, completed=elapsed, cycles=cycles, faults=faults),
            )

    def _facts(self, plan: Plan, outcome: Outcome) -> dict[str, Any]:
        faults = outcome.history.faults
        return {
            "processes": plan.processes,
            "seconds": plan.seconds,
            "ttl": plan.ttl,
            "renew": plan.renew,
            "fence": plan.fence,
            "faults": {kind: sum(1 for fault in faults if fault.kind == kind) for kind in plan.faults},
            "counter": outcome.history.final,
            "writes_committed": len(outcome.history.writes),
            "notes": outcome.notes,
            "timeline": timeline(outcome.history),
        }

    def _table(self, plan: Plan, outcome: Outcome, verdict: Verdict) -> Any:
        from rich.table import Table

        facts = self._facts(plan, outcome)
        table = Table(title=f"distlocks_verify --using {plan.alias}", show_header=False)
        table.add_column("", justify="left")
        table.add_column("", justify="right")
        faults = ", ".join(f"{kind} x{count}" for kind, count in facts["faults"].items()) or "none"
        lease = f"ttl {plan.ttl or locks[plan.alias].default_ttl}s" + ("" if plan.renew else ", not renewed")
        table.add_row("processes, seconds", f"{plan.processes}, {plan.seconds:g}")
        table.add_row("lease", lease + (", fenced writes" if plan.fence else ""))
        table.add_row("faults injected", faults)
        table.add_row("critical sections", str(verdict.cycles))
        table.add_row("writes committed, counter", f"{facts['writes_committed']}, {facts['counter']}")
        rows = [
            ("overlapping sections", len(verdict.overlaps), not plan.fence),
            ("tokens out of order", len(verdict.token_order_violations), True),
            ("stale writes rejected by the fence", verdict.stale_writes_rejected, False),
            ("stale writes accepted", len(verdict.stale_writes_accepted), True),
            ("lost updates", verdict.lost_updates, True),
        ]
        for label, count, counts_as_violation in rows:
            style = "red" if count and counts_as_violation else ("yellow" if count else "green")
            table.add_row(label, str(count), style=style)
        lost = sum(1 for section in outcome.history.sections if section.released == "lost")
        table.add_row("holders told LockLost at release", str(lost))
        return table

    def _report(self, verdict: Verdict, outcome: Outcome) -> None:
        for note in outcome.notes:
            self.stderr.write(f"note: {note}")
        for violation in verdict.violations[:SHOWN]:
            self.stdout.write(f"VIOLATION {violation.kind}: {violation.detail}")
        if len(verdict.violations) > SHOWN:
            self.stdout.write(f"... and {len(verdict.violations) - SHOWN} more (--json lists them all)")
        if not verdict.violations:
            self.stdout.write(f"No violation in {verdict.cycles} critical sections.")


def _stream(wrapper: Any) -> IO[str]:
    """The stream under a command's OutputWrapper, which would add a newline to each of rich's writes."""
    return getattr(wrapper, "_out", wrapper)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """Let SIGTERM end the run as Ctrl-C does: through the cleanup (processes continued and ended, tables dropped)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (call_command from another thread)
        return

    def terminate(number: int, frame: Any) -> None:
        raise SystemExit(128 + number)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
