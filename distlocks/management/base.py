"""What distlocks' management commands share: their ``--version`` is distlocks'."""

from __future__ import annotations

import django
from django.core.management.base import BaseCommand

import distlocks


class DistlocksCommand(BaseCommand):
    """A management command of distlocks."""

    def get_version(self) -> str:
        """Return distlocks' version and Django's, which ``--version`` prints (Django's alone by default)."""
        return f"distlocks {distlocks.__version__} (Django {django.get_version()})"
