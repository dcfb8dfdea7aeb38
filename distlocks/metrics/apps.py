"""Django app configuration for distlocks.metrics."""

from __future__ import annotations

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _


class MetricsConfig(AppConfig):
    name = "distlocks.metrics"
    label = "distlocks_metrics"
    verbose_name = _("Distributed lock metrics")

    def ready(self) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as exc:
            raise ImproperlyConfigured(
                "distlocks.metrics needs prometheus-client: pip install 'distlocks[prometheus]'"
            ) from exc
        from distlocks.metrics import collectors

        collectors.connect()
