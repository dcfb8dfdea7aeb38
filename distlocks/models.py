"""The tables of the database backends (locks, native leases, waiters, read-write holds) and of the beat's dispatches."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.translation import gettext_lazy as _

from distlocks.fencing import FencedModel

if apps.apps_ready and not apps.is_installed("distlocks"):  # instead of Django's RuntimeError about app_label
    raise ImproperlyConfigured(
        'distlocks.models is imported, but "distlocks" is not in INSTALLED_APPS: '
        'add "distlocks" to INSTALLED_APPS, then run migrate.'
    )


class LockNameField(models.CharField):
    """A CharField that compares byte for byte on every database.

    MySQL/MariaDB collations fold case and accents and ignore trailing spaces,
    which would make ``Stock``, ``stock`` and ``stock `` one lock: there the
    column (and so its unique index) gets a binary NO PAD collation. SQLite's
    BINARY and PostgreSQL's deterministic collations compare bytes already.
    """

    def db_parameters(self, connection: BaseDatabaseWrapper) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql" and self.db_collation is None:
            mariadb = connection.mysql_is_mariadb  # type: ignore[attr-defined]
            params["collation"] = "utf8mb4_nopad_bin" if mariadb else "utf8mb4_0900_bin"
        return params


class Held(models.Model):
    """Who holds a lock and since when: the columns every table of holds shares."""

    owner_host = models.CharField(_("owner host"), max_length=255)
    owner_pid = models.PositiveIntegerField(_("owner pid"))
    owner_thread = models.CharField(_("owner thread"), max_length=255)
    # Matched on release and renewal; never shown, never logged.
    owner_secret = models.CharField(max_length=64, editable=False)
    hold_count = models.PositiveIntegerField(_("hold count"), default=1)
    acquired_at = models.DateTimeField(_("acquired at"))

    class Meta:
        abstract = True

    @property
    def owner(self) -> str:
        return f"{self.owner_host}:{self.owner_pid}:{self.owner_thread}"


class Lock(Held):
    """A lock held through ``distlocks.backends.db.DatabaseBackend``.

    The primary key is the fencing token: every acquisition inserts a new row, and
    auto-increment values only grow, across deletes, cleanups and restarts.
    """

    id = models.BigAutoField(primary_key=True, verbose_name=_("fencing token"))
    lock_name = LockNameField(_("lock name"), max_length=255, unique=True)
    expires_at = models.DateTimeField(_("expires at"), db_index=True)

    class Meta:
        verbose_name = _("database lock")
        verbose_name_plural = _("database locks")
        permissions = [("force_release_lock", _("Can force-release a lock"))]

    def __str__(self) -> str:
        return self.lock_name


class HeldLock(Lock):
    """The admin's entry for its held-locks page, in the sidebar and the app index: no table, no permissions.

    The page lists the locks of every backend; who may see it is who may view
    ``Lock`` or force-release locks (see ``distlocks.admin.HeldLockAdmin``).
    """

    class Meta:
        proxy = True
        default_permissions = ()
        verbose_name = _("held lock")
        verbose_name_plural = _("held locks")


class NativeLease(Held):
    """The lease and fencing token of a lock held through a native backend (``GET_LOCK``, advisory locks).

    The server's lock is the mutual exclusion; this row says who holds it, from
    which server session, until when (the lease), and with which token: every
    acquisition writes a new row id, and auto-increment values only grow.
    """

    id = models.BigAutoField(primary_key=True, verbose_name=_("fencing token"))
    lock_name = LockNameField(_("lock name"), max_length=255, unique=True)
    #: What the server locks: the GET_LOCK name, or the advisory lock's 64-bit key.
    lock_key = models.CharField(_("server lock"), max_length=64)
    #: The holder's server session (CONNECTION_ID(), pg_backend_pid()).
    session = models.BigIntegerField(_("server session"))
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        db_table = "distlocks_native_lease"
        verbose_name = _("native lock lease")
        verbose_name_plural = _("native lock leases")

    def __str__(self) -> str:
        return self.lock_name


class LockWaiter(models.Model):
    """A place in the queue of a lock of ``distlocks.backends.db.DatabaseBackend``.

    A waiter takes a freed lock only if no live waiter with a smaller id is
    queued for it, so waiters are served roughly in the order they came. The
    row is a lease too: a waiter that crashed stops holding up the queue once
    its row expires (``WAITER_LEASE`` seconds, renewed while it waits).
    """

    id = models.BigAutoField(primary_key=True, verbose_name=_("place in the queue"))
    lock_name = LockNameField(_("lock name"), max_length=255)
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        verbose_name = _("lock waiter")
        verbose_name_plural = _("lock waiters")
        db_table = "distlocks_lock_waiter"
        indexes = [models.Index(fields=["lock_name", "id"], name="distlocks_waiter_queue")]

    def __str__(self) -> str:
        return self.lock_name


class ReadWriteHold(Held):
    """One hold of a read-write lock through ``DatabaseBackend``: a reader, the writer, or a waiting writer.

    Each holder's row is a lease of its own, and its id is its fencing token.
    Every change to one lock runs in a transaction that first locks the
    lock's "gate" row (one per name, kept), so that changes to one lock run one
    after another.
    """

    id = models.BigAutoField(primary_key=True, verbose_name=_("fencing token"))
    lock_name = LockNameField(_("lock name"), max_length=255)
    #: "read", "write", "waiting" (a writer that waits, which new readers let pass) or "gate".
    mode = models.CharField(_("mode"), max_length=8)
    expires_at = models.DateTimeField(_("expires at"), db_index=True)

    class Meta:
        db_table = "distlocks_rw_hold"
        verbose_name = _("read-write lock hold")
        verbose_name_plural = _("read-write lock holds")
        constraints = [
            models.UniqueConstraint(fields=["lock_name", "mode", "owner_secret"], name="distlocks_rw_hold_unique")
        ]

    def __str__(self) -> str:
        return f"{self.lock_name} ({self.mode})"


class BeatDispatch(FencedModel):
    """The last dispatch of one entry of a Celery beat schedule, claimed with its leader's fencing token.

    ``distlocks.celery.beat`` claims each dispatch with one fenced ``UPDATE``
    that moves ``due_at`` forward: a due time is sent once, and not at all by a
    leader whose term a newer one has replaced.
    """

    #: The schedule's election (``DISTLOCKS_BEAT["NAME"]``).
    schedule = LockNameField(_("schedule"), max_length=255)
    entry = LockNameField(_("entry"), max_length=255)
    #: When the last dispatched run was due, and when it was sent (the entry's ``last_run_at``).
    due_at = models.DateTimeField(_("due at"), null=True)
    ran_at = models.DateTimeField(_("sent at"), null=True)

    class Meta:
        db_table = "distlocks_beat_dispatch"
        verbose_name = _("beat dispatch")
        verbose_name_plural = _("beat dispatches")
        constraints = [models.UniqueConstraint(fields=["schedule", "entry"], name="distlocks_beat_dispatch_unique")]

    def __str__(self) -> str:
        return f"{self.schedule}: {self.entry}"
