"""Prometheus metrics of distlocks: add "distlocks.metrics" to INSTALLED_APPS (needs prometheus-client)."""
