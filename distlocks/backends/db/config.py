"""What a database lock backend's settings name, and what to tell its user about them.

The ``DATABASES`` entry a backend locks in, its ``OPTIONS`` (checked at once),
and the messages for what goes wrong there: the database missing from the
settings or of the wrong kind, not migrated, or not answering (host and port
named, never a password).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionDoesNotExist

from distlocks.backends.arguments import check_positive_number
from distlocks.exceptions import BackendUnavailable

#: How long a lock statement may run by default (``OPTIONS['TIMEOUT']``), in seconds.
DEFAULT_TIMEOUT = 5.0


def missing_table(exc: BaseException) -> bool:
    """True if ``exc`` says a table does not exist: the lock database was not migrated."""
    if getattr(exc.__cause__, "sqlstate", None) == "42P01":  # PostgreSQL's undefined_table
        return True
    if exc.args and exc.args[0] == 1146:  # MySQL's ER_NO_SUCH_TABLE
        return True
    return "no such table" in str(exc)  # SQLite


class Unmigrated(ImproperlyConfigured):
    """A lock database without distlocks' tables (not BackendUnavailable: the server answered)."""


def unmigrated(alias: str, database: str) -> Unmigrated:
    return Unmigrated(
        f"DISTLOCKS[{alias!r}]: database {database!r} has no distlocks tables: "
        f"run `python manage.py migrate --database {database}`"
    )


def unmigrated_warning(
    alias: str, database: str, table: str, ask: Callable[[str], object]
) -> list[checks.CheckMessage]:
    """For a backend's ``ping()``: W014 if ``ask(sql)`` finds ``table`` missing in ``database``.

    A warning, not an error: ``manage.py check`` may run before ``migrate``.
    Never for the default database, which a plain ``migrate`` migrates (a new
    project checked before its first ``migrate`` gets no warning); the other
    databases a ``DISTLOCKS`` entry names need ``migrate --database``, which is
    easily forgotten.
    """
    if database == DEFAULT_DB_ALIAS:
        return []
    try:
        ask(f"SELECT 1 FROM {table} WHERE 1 = 0")
    except Unmigrated as exc:
        return [
            checks.Warning(
                str(exc),
                hint=f"Until then locks on {alias!r} raise ImproperlyConfigured. "
                "Each database a DISTLOCKS entry names needs the migrations, not only 'default'.",
                id="distlocks.W014",
            )
        ]
    return []


def database_of(alias: str, database: str) -> BaseDatabaseWrapper:
    """The Django connection a lock backend's ``OPTIONS['DATABASE']`` names; ImproperlyConfigured if none."""
    try:
        return connections[database]
    except ConnectionDoesNotExist as exc:
        raise ImproperlyConfigured(
            f"DISTLOCKS[{alias!r}]['OPTIONS']['DATABASE'] names {database!r}, which is not in DATABASES"
        ) from exc


def database_address(database: str) -> str:
    """Where a DATABASES entry points, for messages: its host:port and name, never its password."""
    settings_dict = connections.settings[database] if database in connections else {}
    where = ":".join(str(part) for part in (settings_dict.get("HOST"), settings_dict.get("PORT")) if part)
    return f"database {database!r} ({where + ' ' if where else ''}{settings_dict.get('NAME', '')})"


def unavailable(alias: str, database: str, error: BaseException | None) -> BackendUnavailable:
    """BackendUnavailable naming the host and port tried: mysqlclient's errors name the host only."""
    address = database_address(database)
    return BackendUnavailable(f"D{address[1:]} for locks on {alias!r} is unavailable: {error}", alias=alias)


def missing_database(alias: str, database: str) -> checks.CheckMessage:
    """The system check error for a lock backend whose ``OPTIONS['DATABASE']`` is not in ``DATABASES``."""
    return checks.Error(
        f"DISTLOCKS[{alias!r}] uses database {database!r}, which is not in DATABASES.",
        hint=f"Set OPTIONS['DATABASE'] to one of: {', '.join(connections)}.",
        id="distlocks.E003",
    )


#: The OPTIONS of a database lock backend (``connection_options`` reads them).
CONNECTION_OPTIONS = ("DATABASE", "CONNECT_TIMEOUT", "TIMEOUT")
#: What a database lock backend reads instead of LOCATION.
LOCATION_INSTEAD = (
    "OPTIONS['DATABASE'] names the database (an alias of DATABASES, default 'default') "
    "whose connection settings the locks use."
)


def connection_options(alias: str, options: dict[str, Any]) -> tuple[str, float, float]:
    """A database lock backend's ``OPTIONS``: (DATABASE, CONNECT_TIMEOUT, TIMEOUT), checked."""
    try:
        timeout = check_positive_number(options.get("TIMEOUT", DEFAULT_TIMEOUT), "OPTIONS['TIMEOUT']")
        # Checked too: 0 or less would have libpq and mysqlclient wait for a silent server without end.
        connect_timeout = check_positive_number(options.get("CONNECT_TIMEOUT", 5), "OPTIONS['CONNECT_TIMEOUT']")
    except ValueError as exc:
        raise ImproperlyConfigured(f"DISTLOCKS[{alias!r}]: {exc}") from exc
    return options.get("DATABASE", DEFAULT_DB_ALIAS), connect_timeout, timeout


def wrong_database(backend: Any, vendor: str) -> str | None:
    """Why a database of ``vendor`` is not ``backend``'s kind (None: it is); names a misspelt ``DATABASE`` option."""
    if vendor == backend.vendor:
        return None
    why = ""
    if "DATABASE" not in backend.options:  # a typo such as 'DATABSE' left the default database
        unknown = ", ".join(repr(key) for key in backend.options if key not in CONNECTION_OPTIONS)
        why = f"; OPTIONS has {unknown}, which it does not read" if unknown else ""
        why = f" (OPTIONS['DATABASE'] is not set{why})"
    kind = type(backend).__name__
    return f"DISTLOCKS[{backend.alias!r}] ({kind}) needs a {backend.vendor} database; {backend.database!r} is {vendor}{why}"
