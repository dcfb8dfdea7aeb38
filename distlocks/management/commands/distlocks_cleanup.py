"""Delete the state of expired locks."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from distlocks.exceptions import LockError
from distlocks.handler import locks
from distlocks.inspection import clear_expired
from distlocks.management.base import DistlocksCommand


class Command(DistlocksCommand):
    help = "Delete the state that expired locks leave behind (database rows, unused Redis counters); print how many."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--using", action="append", help="Only this DISTLOCKS alias (repeatable).")
        parser.add_argument("--dry-run", action="store_true", help="Count what would be deleted, delete nothing.")

    def handle(self, *args: Any, using: list[str] | None, dry_run: bool, **options: Any) -> None:
        verb = "would delete" if dry_run else "deleted"
        for alias in using or list(locks):
            try:
                count, noun = clear_expired(alias, dry_run=dry_run)
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            except NotImplementedError:
                self.stdout.write(f"{alias}: nothing to clean up (the backend keeps no expired state)")
                continue
            except LockError as exc:
                raise CommandError(f"{alias}: {exc}") from exc
            self.stdout.write(f"{alias}: {verb} {count} {noun}")
