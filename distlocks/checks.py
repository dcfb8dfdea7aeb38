"""System checks for the DISTLOCKS setting."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured


@checks.register("distlocks")
def check_distlocks(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report every misconfigured DISTLOCKS entry, then each backend's own findings."""
    from distlocks.handler import LockHandler

    handler = LockHandler()
    try:
        aliases = list(handler.settings)
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="See DISTLOCKS in the distlocks README.", id="distlocks.E001")]
    messages: list[checks.CheckMessage] = []
    for alias in aliases:
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
        messages.extend(backend.check())
    return messages
