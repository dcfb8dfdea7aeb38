"""The ``locks`` registry of configured backends, in the style of ``django.core.cache.caches``."""

from __future__ import annotations

import difflib
import threading
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings as django_settings
from django.core import checks
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


class _Backends(threading.local):
    """A thread's backend instances, by alias."""

    def __init__(self) -> None:
        self.backends: dict[str, BaseLockBackend] = {}


class LockHandler(BaseConnectionHandler):
    """Create one backend instance per alias and thread, lazily.

    The instances live in a plain thread-local dict: every acquire and release
    looks its backend up, and asgiref's ``Local`` costs microseconds per lookup.
    """

    settings_name = "DISTLOCKS"
    exception_class = ImproperlyConfigured

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        self._connections = _Backends()

    def configure_settings(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        if settings is None:
            settings = getattr(django_settings, self.settings_name, None)
        if settings is None:
            return {alias: dict(params) for alias, params in DEFAULT_SETTINGS.items()}
        if not isinstance(settings, dict):
            raise ImproperlyConfigured("DISTLOCKS must be a dict of aliases, like CACHES")
        return settings

    def __getitem__(self, alias: str) -> BaseLockBackend:
        backends = self._connections.backends
        backend = backends.get(alias)
        if backend is None:
            if alias not in self.settings:
                known = ", ".join(repr(a) for a in self.settings) or "none"
                raise ImproperlyConfigured(f"DISTLOCKS has no alias {alias!r} (configured: {known})")
            backend = backends[alias] = self.first_use(alias)
        return backend

    def first_use(self, alias: str) -> BaseLockBackend:
        """Create the backend of ``alias``, refusing what ``manage.py check`` reports but locking would not notice.

        A key the backend does not read (a typo: ``"TLL"`` leaves the default
        ttl), or a backend that keeps its locks in distlocks' tables while the
        app is not installed, raise ImproperlyConfigured here: a server started
        by gunicorn never runs ``check``.
        """
        errors = unknown_settings(alias, self.settings[alias])
        if errors:
            raise ImproperlyConfigured(" ".join(f"{error.msg} {error.hint}" for error in errors))
        backend = self.create_connection(alias)
        if backend.needs_app and not app_installed():
            raise ImproperlyConfigured(not_installed([(alias, type(backend))]))
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
        self._connections = _Backends()


def app_installed() -> bool:
    """Return False if the app registry is ready without the distlocks app (True before: it cannot say yet)."""
    return not apps.apps_ready or apps.is_installed("distlocks")


def not_installed(needing: list[tuple[str, type]]) -> str:
    """What forgetting the app breaks, and the fix: ``needing`` is the (alias, backend class) that need its tables."""
    which = ", ".join(f"{alias!r} ({backend_class.__name__})" for alias, backend_class in needing)
    return (
        f"Locks on {which} are kept in the tables of the distlocks app, which is not in INSTALLED_APPS: "
        'add "distlocks" to INSTALLED_APPS, then run migrate.'
    )


@checks.register("distlocks")
def check_installed(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report the aliases whose backend needs the distlocks app when it is not installed.

    Registered when this module is imported, not in ``DistlocksConfig.ready()``,
    which a project without the app never runs: so ``check`` reports it if the
    project imported distlocks before the checks ran (its settings or an
    installed app did). Importing distlocks later, as a URLconf does, raises
    the same error (``refuse_without_app``).
    """
    if app_installed():
        return []
    needing = needing_the_app()
    if not needing:
        return []
    return [checks.Error(not_installed(needing), hint='Add "distlocks" to INSTALLED_APPS.', id="distlocks.E013")]


def needing_the_app() -> list[tuple[str, type]]:
    """The (alias, backend class) of DISTLOCKS whose backend keeps its locks in distlocks' tables."""
    try:
        entries = LockHandler().settings
    except ImproperlyConfigured:  # E001's business
        return []
    needing: list[tuple[str, type]] = []
    for alias, params in entries.items():
        try:
            backend_class = import_string(params["BACKEND"])
        except (TypeError, KeyError, ImportError):  # E002's business
            continue
        if getattr(backend_class, "needs_app", False):
            needing.append((alias, backend_class))
    return needing


def refuse_without_app() -> None:
    """Raise ImproperlyConfigured if distlocks is imported once the app registry is ready without its app.

    As Django's models do (a model of an app that is not installed fails at
    import): ``check``, which imports the URLconf and so the views, then fails
    naming the fix, instead of the first lock failing in production.
    """
    if not app_installed():
        needing = needing_the_app()
        if needing:
            raise ImproperlyConfigured(not_installed(needing))


def unknown_settings(alias: str, params: Any) -> list[checks.CheckMessage]:
    """Report the keys of DISTLOCKS[alias], and of its OPTIONS, that its backend does not read (typos).

    The backend class declares them (``setting_names``, ``option_names``,
    ``location_instead``); an entry whose BACKEND cannot be imported is
    E002's business. ``manage.py check`` reports them (E010, E011), and the
    first use of the alias raises them.
    """
    try:
        backend_class = import_string(params["BACKEND"])
        names, option_names = backend_class.setting_names, backend_class.option_names
    except (TypeError, KeyError, AttributeError, ImportError):  # no dict, no or a bad BACKEND: E002 says which
        return []
    messages: list[checks.CheckMessage] = [
        _unknown(f"DISTLOCKS[{alias!r}]", key, names) for key in params if key not in names
    ]
    options = params.get("OPTIONS")
    if option_names is not None and isinstance(options, dict):
        where = f"DISTLOCKS[{alias!r}]['OPTIONS']"
        messages += [_unknown(where, key, option_names, backend_class) for key in options if key not in option_names]
    if "LOCATION" in params and backend_class.location_instead:
        messages.append(
            checks.Error(
                f"DISTLOCKS[{alias!r}] sets LOCATION, which {backend_class.__name__} does not read.",
                hint=f"Remove it: {backend_class.location_instead}",
                id="distlocks.E011",
            )
        )
    return messages


def _unknown(where: str, key: Any, names: tuple[str, ...], backend_class: type | None = None) -> checks.Error:
    """An unknown key ``key`` of ``where``: a typo, with the closest accepted name and all of them."""
    close = difflib.get_close_matches(str(key).upper(), names, n=1)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    of = f" of {backend_class.__name__}" if backend_class is not None else ""
    return checks.Error(
        f"{where} has an unknown key {key!r}.{guess}",
        hint=f"The keys{of}: {', '.join(names) or 'none (it takes no OPTIONS)'}.",
        id="distlocks.E010",
    )


locks = LockHandler()
refuse_without_app()
