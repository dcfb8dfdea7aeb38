"""The ``locks`` registry of configured backends, in the style of ``django.core.cache.caches``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.connection import BaseConnectionHandler
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from distlocks.backends.base import BaseLockBackend

DEFAULT_ALIAS = "default"
DEFAULT_SETTINGS = {DEFAULT_ALIAS: {"BACKEND": "distlocks.backends.db.DatabaseBackend"}}
BUILTIN_BACKENDS = (
    "distlocks.backends.db.DatabaseBackend",
    "distlocks.backends.mysql.MySQLLockBackend",
    "distlocks.backends.postgresql.AdvisoryLockBackend",
    "distlocks.backends.redis.RedisBackend",
    "distlocks.backends.redlock.RedlockBackend",
    "distlocks.backends.zookeeper.ZooKeeperBackend",
    "distlocks.backends.locmem.LocMemBackend",
)


class LockHandler(BaseConnectionHandler):
    """Create one backend instance per alias and thread, lazily.

    The instances live in a plain thread-local dict: every acquire and release
    looks its backend up, and asgiref's ``Local`` costs microseconds per lookup.
    """

    settings_name = "DISTLOCKS"
    exception_class = ImproperlyConfigured

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        self._connections = threading.local()

    def configure_settings(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        if settings is None:
            settings = getattr(django_settings, self.settings_name, None)
        if settings is None:
            return {alias: dict(params) for alias, params in DEFAULT_SETTINGS.items()}
        if not isinstance(settings, dict):
            raise ImproperlyConfigured("DISTLOCKS must be a dict of aliases, like CACHES")
        return settings

    def __getitem__(self, alias: str) -> BaseLockBackend:
        backends: dict[str, BaseLockBackend] | None = getattr(self._connections, "backends", None)
        if backends is None:
            backends = self._connections.backends = {}
        backend = backends.get(alias)
        if backend is None:
            if alias not in self.settings:
                known = ", ".join(repr(a) for a in self.settings) or "none"
                raise ImproperlyConfigured(f"DISTLOCKS has no alias {alias!r} (configured: {known})")
            backend = backends[alias] = self.create_connection(alias)
        return backend

    def create_connection(self, alias: str) -> BaseLockBackend:
        params = self.settings[alias]
        if not isinstance(params, dict):
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}] must be a dict, not {type(params).__name__}")
        params = dict(params)
        path = params.pop("BACKEND", None)
        if not path:
            raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}] has no 'BACKEND'")
        try:
            backend_class = import_string(path)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCKS[{alias!r}]: cannot import BACKEND {path!r} ({exc}). "
                f"Built-in backends: {', '.join(BUILTIN_BACKENDS)}"
            ) from exc
        backend: BaseLockBackend = backend_class(alias, params)
        return backend

    def reset(self) -> None:
        """Forget the settings and every backend instance (on ``setting_changed``)."""
        self.__dict__.pop("settings", None)
        self._settings = None
        self._connections = threading.local()


locks = LockHandler()
