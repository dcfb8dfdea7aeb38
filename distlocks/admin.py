"""Admin for the database backend's Lock table (read-only: locks change only through the lock API)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from distlocks.models import Lock


class ExpiredFilter(admin.SimpleListFilter):
    title = _("lease")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("no", _("live")), ("yes", _("expired"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        if self.value() == "yes":
            return queryset.filter(expires_at__lte=Now())
        if self.value() == "no":
            return queryset.filter(expires_at__gt=Now())
        return queryset


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    # owner_secret is never shown: whoever holds it can release the lock.
    list_display = fields = readonly_fields = (
        "lock_name",
        "owner_host",
        "owner_pid",
        "owner_thread",
        "hold_count",
        "id",
        "acquired_at",
        "expires_at",
    )
    list_filter = [ExpiredFilter]
    search_fields = ["lock_name", "owner_host"]
    ordering = ["lock_name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False
