"""Print the locks held right now in every configured backend."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from distlocks.inspection import held_locks
from distlocks.management.base import DistlocksCommand

COLUMNS = ("alias", "key", "kind", "owner", "hold_count", "token", "lease_left", "waiters")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if isinstance(value, float) else str(value)


class Command(DistlocksCommand):
    help = "Print the locks held right now (as the admin shows them); exit 1 if a backend could not be asked."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--using", action="append", help="Only this DISTLOCKS alias (repeatable).")
        parser.add_argument(
            "--json", dest="as_json", action="store_true", help="Print a JSON list of objects instead of a table."
        )

    def handle(self, *args: Any, using: list[str] | None, as_json: bool, **options: Any) -> None:
        try:
            found = held_locks(using)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        now = datetime.now(timezone.utc)
        rows = [info.as_dict(now) for info in found.locks]
        if as_json:
            self.stdout.write(json.dumps(rows, indent=2))
        else:
            self._table(rows)
        for alias, reason in found.errors.items():
            self.stderr.write(f"{alias}: cannot list locks: {reason}")
        if found.errors:
            raise CommandError(f"could not list the locks of: {', '.join(found.errors)}")

    def _table(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.stdout.write("No locks are held.")
            return
        cells = [COLUMNS, *[tuple(_cell(row[column]) for column in COLUMNS) for row in rows]]
        widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
        for line in cells:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
