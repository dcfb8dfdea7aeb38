"""OpenTelemetry spans of distlocks: add "distlocks.tracing" to INSTALLED_APPS (needs opentelemetry-api)."""
