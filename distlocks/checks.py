"""System checks for the DISTLOCKS setting, and whether each backend's server answers."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from distlocks.exceptions import LockError
from distlocks.handler import LockHandler, app_installed, unknown_settings

if TYPE_CHECKING:
    from distlocks.backends.base import BaseLockBackend

#: How long the checks wait for the servers (all asked at once) before warning.
PING_SECONDS = 3.0


@checks.register("distlocks")
def check_distlocks(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report every misconfigured DISTLOCKS entry and each backend's own findings, then ping the sound ones."""
    if not app_installed():  # the tables are missing: check_installed says so, and the backends' checks would fail
        return []
    handler = LockHandler()
    try:
        aliases = list(handler.settings)
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                str(exc),
                hint="See the Settings page of the distlocks docs (docs/reference/settings.md).",
                id="distlocks.E001",
            )
        ]
    messages: list[checks.CheckMessage] = []
    sound: list[BaseLockBackend] = []
    for alias in aliases:
        typos = unknown_settings(alias, handler.settings[alias])
        messages.extend(typos)
        try:
            backend = handler.create_connection(alias)
        except ImproperlyConfigured as exc:
            messages.append(
                checks.Error(
                    str(exc),
                    hint="Each entry needs BACKEND (a dotted path), and may set LOCATION, OPTIONS, TTL and KEY_PREFIX.",
                    id="distlocks.E002",
                )
            )
            continue
        found = backend.check()
        messages.extend(found)
        found += typos  # an entry with a typo may name another server than meant: no ping
        if not any(message.is_serious() for message in found):
            sound.append(backend)
    return messages + unanswered(sound)


def unanswered(backends: list[BaseLockBackend], seconds: float = PING_SECONDS) -> list[checks.CheckMessage]:
    """Warn about each backend whose server fails or gives no answer within ``seconds`` (all pinged at once).

    A warning, not an error: a server may come up after the project does, and
    until then its locks raise BackendUnavailable. A failure is named as the
    server or driver said it (a wrong password, no such database). The
    warnings a server's answer gave (its ``ping()``'s) come first.
    """
    failures: dict[str, str] = {}
    answered: set[str] = set()
    found: dict[str, list[checks.CheckMessage]] = {}

    def ping(backend: BaseLockBackend) -> None:
        try:
            found[backend.alias] = backend.ping() or []
            answered.add(backend.alias)
        except (LockError, ImproperlyConfigured) as exc:
            failures[backend.alias] = str(exc)
        except Exception as exc:  # a driver's error that a backend let through: a warning too, not a thread's traceback
            failures[backend.alias] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"

    threads = [threading.Thread(target=ping, args=(backend,), daemon=True) for backend in backends]
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    done = set(answered)  # as it was at the deadline: a late answer must not drop a warning
    return [message for backend in backends if backend.alias in done for message in found[backend.alias]] + [
        checks.Warning(
            f"DISTLOCKS[{backend.alias!r}]: "
            f"{failures.get(backend.alias, f'the server gives no answer within {seconds:g} s')}",
            hint=f"Is it running at {backend.address}? Until it answers, locks on {backend.alias!r} "
            "raise BackendUnavailable.",
            id="distlocks.W004",
        )
        for backend in backends
        if backend.alias not in done
    ]
