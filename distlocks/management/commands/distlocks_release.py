"""Force-release a lock from the shell, whoever holds it."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from distlocks.exceptions import LockError
from distlocks.handler import DEFAULT_ALIAS
from distlocks.inspection import force_release


class Command(BaseCommand):
    help = (
        "Force-release the lock NAME (as distlocks_list shows it), whoever holds it. "
        "Its holder gets LockLost when it next renews or releases."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The lock's name, as distlocks_list prints it.")
        parser.add_argument("--using", default=DEFAULT_ALIAS, help="The DISTLOCKS alias (default: %(default)s).")
        parser.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")

    def handle(self, *args: Any, name: str, using: str, yes: bool, **options: Any) -> None:
        if not yes:
            try:
                answer = input(f"Force-release {name!r} on {using!r}? Its holder loses it. [y/N] ")
            except EOFError:  # no terminal to ask: do nothing
                answer = ""
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("Not released.")
        try:
            released = force_release(using, name)
        except (ImproperlyConfigured, LockError) as exc:
            raise CommandError(f"{using}: {exc}") from exc
        if not released:
            raise CommandError(f"{using}: {name!r} is not held")
        self.stdout.write(f"{using}: released {name!r}")
