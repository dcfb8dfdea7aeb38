"""Django app configuration for distlocks."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core.signals import setting_changed
from django.utils.translation import gettext_lazy as _


def _reset_locks(*, setting: str, **kwargs: Any) -> None:
    if setting in ("DISTLOCKS", "CACHES"):  # backends keep their cache's client
        from distlocks.handler import locks

        locks.reset()


class DistlocksConfig(AppConfig):
    name = "distlocks"
    verbose_name = _("Distributed locks")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from distlocks import checks  # noqa: F401  (registers the checks)

        setting_changed.connect(_reset_locks, dispatch_uid="distlocks.reset_locks")
