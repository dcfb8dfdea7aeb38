"""Django app configuration for distlocks.tracing."""

from __future__ import annotations

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _


class TracingConfig(AppConfig):
    name = "distlocks.tracing"
    label = "distlocks_tracing"
    verbose_name = _("Distributed lock tracing")

    def ready(self) -> None:
        try:
            import opentelemetry.trace  # noqa: F401
        except ImportError as exc:
            raise ImproperlyConfigured(
                "distlocks.tracing needs opentelemetry-api: pip install 'distlocks[opentelemetry]'"
            ) from exc
        from distlocks.tracing import spans

        spans.connect()
