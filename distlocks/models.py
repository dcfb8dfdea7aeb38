"""The Lock table of the database backend."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class Lock(models.Model):
    """A lock held through ``distlocks.backends.db.DatabaseBackend``.

    The primary key is the fencing token: every acquisition inserts a new row, and
    auto-increment values only grow, across deletes, cleanups and restarts.
    """

    id = models.BigAutoField(primary_key=True, verbose_name=_("fencing token"))
    lock_name = models.CharField(_("lock name"), max_length=255, unique=True)
    owner_host = models.CharField(_("owner host"), max_length=255)
    owner_pid = models.PositiveIntegerField(_("owner pid"))
    owner_thread = models.CharField(_("owner thread"), max_length=255)
    # Matched on release and renewal; never shown, never logged.
    owner_secret = models.CharField(max_length=64, editable=False)
    hold_count = models.PositiveIntegerField(_("hold count"), default=1)
    acquired_at = models.DateTimeField(_("acquired at"))
    expires_at = models.DateTimeField(_("expires at"), db_index=True)

    class Meta:
        verbose_name = _("database lock")
        verbose_name_plural = _("database locks")
        permissions = [("force_release_lock", _("Can force-release a lock"))]

    def __str__(self) -> str:
        return self.lock_name

    @property
    def owner(self) -> str:
        return f"{self.owner_host}:{self.owner_pid}:{self.owner_thread}"
