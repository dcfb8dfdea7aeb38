"""Force-release a lock from the shell, whoever holds it."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from distlocks.exceptions import LockError
from distlocks.handler import DEFAULT_ALIAS
from distlocks.inspection import READ_WRITE, force_release, holder, prefixed_key
from distlocks.management.base import DistlocksCommand


class Command(DistlocksCommand):
    help = (
        "Force-release the lock KEY (as distlocks_list shows it), whoever holds it. "
        "Its holder gets LockLost when it next renews or releases."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "key",
            help="The lock's key, as distlocks_list prints it (its name with the alias's KEY_PREFIX); "
            "its bare name works too when no lock is stored under that key.",
        )
        parser.add_argument("--using", default=DEFAULT_ALIAS, help="The DISTLOCKS alias (default: %(default)s).")
        parser.add_argument(
            "--token",
            type=int,
            help="Release it only if it is still this acquisition (its TOKEN in distlocks_list). "
            "By default: the acquisition found when the command looks.",
        )
        parser.add_argument(
            "--kind",
            choices=READ_WRITE,
            help="For a read-write lock (its KIND in distlocks_list): release a holder of this side "
            "(with --token, that one; else the first found).",
        )
        parser.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")

    def handle(
        self, *args: Any, key: str, using: str, token: int | None, kind: str | None, yes: bool, **options: Any
    ) -> None:
        kind = kind or "lock"
        hint = ""
        try:
            prefixed = prefixed_key(using, key)
            if prefixed is not None:
                key, hint = self._resolve(using, key, prefixed, kind)
            if token is None:
                token, holder = self._holder(using, key, kind, hint)
            else:
                holder = f"token {token}"
            if not yes:
                try:
                    answer = input(f"Force-release {key!r} on {using!r} ({holder})? Its holder loses it. [y/N] ")
                except EOFError:  # no terminal to ask: do nothing
                    answer = ""
                if answer.strip().lower() not in ("y", "yes"):
                    raise CommandError("Not released.")
            # Only the acquisition looked at: one taken since then stays with its new holder.
            released = force_release(using, key, token, kind=kind)
        except (ImproperlyConfigured, LockError) as exc:
            raise CommandError(f"{using}: {exc}") from exc
        if not released:
            raise CommandError(
                f"{using}: {key!r} is not held" + (f" with token {token}" if token is not None else "") + hint
            )
        self.stdout.write(f"{using}: released {key!r}")

    def _resolve(self, using: str, key: str, prefixed: str, kind: str) -> tuple[str, str]:
        """The key to release (``key`` if a lock is stored under it, else ``prefixed`` if one is) and a hint.

        ``key`` is tried first: another alias sharing the server may store it
        as given. The hint ("did you mean ...?") goes into the "not held" error
        when neither could be looked at or neither is held.
        """
        hint = f" (did you mean {prefixed!r}? {using!r} has KEY_PREFIX {prefixed[: -len(key) - 1]!r})"
        try:
            if holder(using, key, kind) is None and holder(using, prefixed, kind) is not None:
                return prefixed, ""
        except NotImplementedError:  # the backend cannot look: say which key was meant
            pass
        return key, hint

    def _holder(self, using: str, key: str, kind: str, hint: str = "") -> tuple[int | None, str]:
        """The current acquisition's token and a description of its holder."""
        try:
            info = holder(using, key, kind)
        except NotImplementedError:
            return None, "whoever holds it"
        if info is None:
            raise CommandError(f"{using}: {key!r} is not held{hint}")
        return info.token, f"held by {info.owner or '?'}, token {info.token}"
