"""Admin for distlocks: the database backend's Lock table, and the locks held in every backend."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.exceptions import NotRegistered
from django.contrib.admin.models import DELETION, LogEntry
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.translation import gettext as _g
from django.utils.translation import gettext_lazy as _

from distlocks.backends.base import LockInfo
from distlocks.exceptions import LockError
from distlocks.handler import locks
from distlocks.inspection import KINDS, READ_WRITE, force_release, held_locks
from distlocks.models import HeldLock, Lock

#: The query parameters of the held-locks page.
SEARCH_VAR = "q"
PAGE_VAR = "p"  # the changelist's
ALIAS_VAR = "alias"
KIND_VAR = "kind"
#: How the page names each kind of lock (see ``inspection.KINDS``).
KIND_LABELS = {
    "lock": _("lock"),
    "semaphore": _("semaphore"),
    "multi": _("multi-lock"),
    "read": _("read-write: read"),
    "write": _("read-write: write"),
    "leader": _("leader"),
}
#: The POST fields of the held-locks page: the ticked rows, and the confirmation.
SELECTED_VAR = "_selected_lock"
CONFIRM_VAR = "post"
#: How many of a long token's last digits the page shows (the whole token on hover).
SHORT_TOKEN_DIGITS = 6


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


@dataclass(frozen=True)
class HeldLockRow:
    """A held lock as one row of the page, with what the template cannot compute."""

    info: LockInfo
    lease_left: float | None

    @property
    def value(self) -> str:
        """The row's checkbox value: which lock, which acquisition of it (its token), and its kind."""
        return json.dumps([self.info.alias, self.info.key, self.info.token, self.info.kind])

    @property
    def short_token(self) -> str | None:
        """A long token (Redis': 16 digits) cut to its last digits, which differ between its locks; else None."""
        token = "" if self.info.token is None else str(self.info.token)
        return f"…{token[-SHORT_TOKEN_DIGITS:]}" if len(token) > SHORT_TOKEN_DIGITS + 2 else None

    @property
    def kind_label(self) -> str:
        return str(KIND_LABELS.get(self.info.kind, self.info.kind))

    @property
    def owner_parts(self) -> list[str]:
        """The owner cut after each ":" and "/", where the page may break it across lines."""
        return [part for part in re.findall(r"[^:/]*[:/]?", self.info.owner) if part]

    @property
    def label(self) -> str:
        return f"{self.info.alias}: {self.info.key}"


Choice = tuple[str, str, int | None, str]


def _parse_choice(value: str) -> Choice | None:
    """(alias, name, token, kind) from a row's checkbox value (kind "lock" if left out), or None."""
    try:
        alias, name, token, *more = json.loads(value)
    except (ValueError, TypeError):
        return None
    kind = more[0] if more else "lock"
    if not isinstance(alias, str) or not isinstance(name, str) or not (token is None or isinstance(token, int)):
        return None
    if len(more) > 1 or kind not in KINDS:
        return None
    return alias, name, token, kind


def _label(alias: str, name: str, token: int | None, kind: str) -> str:
    """A chosen lock as messages name it: a read-write lock's holder with its side."""
    return f"{alias}: {name} ({kind})" if kind in READ_WRITE else f"{alias}: {name}"


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    """The ``Lock`` rows of the database backend (read-only), and the page of held locks.

    The held-locks page (``admin:distlocks_lock_held``) lists the locks held right
    now in every ``DISTLOCKS`` backend. Whoever may view ``Lock`` (or holds
    ``distlocks.force_release_lock``) sees it; only ``force_release_lock`` gives
    the force-release buttons, and each release is written to the admin log.
    """

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

    held_locks_template = "admin/distlocks/lock/held_locks.html"
    #: Rows on one page of held locks, as ``list_per_page`` on a changelist.
    held_locks_per_page = 100
    force_release_confirmation_template = "admin/distlocks/lock/force_release_confirmation.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        # Who may break a lock may see the locks.
        return super().has_view_permission(request, obj) or self.has_force_release_permission(request)

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        """Return True if the user may force-release locks held by others."""
        return request.user.has_perm(f"{self.opts.app_label}.force_release_lock")

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_held"
        view = self.admin_site.admin_view(self.held_locks_view)
        held = path("held/", view, name=name)
        # The sidebar's and the app index's "Held locks" (HeldLockAdmin) links here, by its changelist's name.
        entry = path("held/", view, name=f"{HeldLock._meta.app_label}_{HeldLock._meta.model_name}_changelist")
        # Before the inherited "<path:object_id>/" patterns, which would take "held/".
        return [held, entry, *super().get_urls()]

    def held_locks_view(self, request: HttpRequest) -> HttpResponse:
        """List the locks held in every backend; on POST, confirm then force-release the chosen ones."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if not self.has_force_release_permission(request):
                raise PermissionDenied
            return self._post_force_release(request)

        query = request.GET.get(SEARCH_VAR, "").strip()
        aliases = list(locks)
        chosen_alias = request.GET.get(ALIAS_VAR) or None
        errors: dict[str, str] = {}
        if chosen_alias is not None and chosen_alias not in aliases:
            errors[chosen_alias] = _g("no such backend in DISTLOCKS")
            found: list[LockInfo] = []
        else:
            found, errors = self._held(aliases if chosen_alias is None else [chosen_alias])
        chosen_kind = request.GET.get(KIND_VAR) or None
        if chosen_kind is not None:
            found = [info for info in found if info.kind == chosen_kind]
        if query:
            needle = query.casefold()
            found = [info for info in found if needle in info.key.casefold() or needle in info.owner.casefold()]
        page = Paginator(found, self.held_locks_per_page).get_page(request.GET.get(PAGE_VAR))
        now = datetime.now(timezone.utc)
        rows = [HeldLockRow(info, info.lease_left(now)) for info in page]

        context = {
            **self.admin_site.each_context(request),
            "title": _g("Locks held in every backend"),
            "subtitle": None,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "rows": rows,
            "page": page,
            "page_links": self._page_links(request, page) if page.paginator.num_pages > 1 else [],
            "backend_errors": sorted(errors.items()),
            "can_force_release": self.has_force_release_permission(request),
            "search_var": SEARCH_VAR,
            "query": query,
            "alias_choices": self._alias_choices(request, aliases, chosen_alias),
            "chosen_alias": chosen_alias,
            "kind_choices": self._choices(
                request, KIND_VAR, [(kind, KIND_LABELS[kind]) for kind in KINDS], chosen_kind
            ),
            "chosen_kind": chosen_kind,
            "selected_var": SELECTED_VAR,
            "has_waiters": any(row.info.waiters is not None for row in rows),
            "recent_charts": self._recent_charts(chosen_alias),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.held_locks_template, context)

    @staticmethod
    def _page_links(request: HttpRequest, page: Page[LockInfo]) -> list[tuple[int | str, str]]:
        """(page number or the ellipsis, query string) for each page link, keeping the search and the filters."""
        params = request.GET.copy()
        links = []
        for number in page.paginator.get_elided_page_range(page.number, on_each_side=2, on_ends=1):
            params[PAGE_VAR] = str(number)
            links.append((number, "" if number == page.paginator.ELLIPSIS else f"?{params.urlencode()}"))
        return links

    def _recent_charts(self, alias: str | None) -> list[Any]:
        """Charts of the last minutes' waits and losses, where distlocks.metrics is installed."""
        if not apps.is_installed("distlocks.metrics"):
            return []
        from distlocks.metrics.recent import charts

        return [chart for chart in charts() if alias is None or chart.alias == alias]

    def _held(self, aliases: Sequence[str]) -> tuple[list[LockInfo], dict[str, str]]:
        found: list[LockInfo] = []
        errors: dict[str, str] = {}
        for alias in aliases:
            # One alias at a time: a misconfigured entry must not hide the others either.
            try:
                held = held_locks([alias])
            except ImproperlyConfigured as exc:
                errors[alias] = str(exc)
                continue
            found.extend(held.locks)
            errors.update(held.errors)
        return found, errors

    def _alias_choices(
        self, request: HttpRequest, aliases: Sequence[str], chosen: str | None
    ) -> list[tuple[str, str, bool]]:
        """(display, query string, selected) for the "By backend" filter, keeping the search."""
        return self._choices(request, ALIAS_VAR, [(alias, alias) for alias in aliases], chosen)

    @staticmethod
    def _choices(
        request: HttpRequest, var: str, values: Sequence[tuple[str, Any]], chosen: str | None
    ) -> list[tuple[str, str, bool]]:
        """(display, query string, selected) for a filter on ``var``, keeping the search and the other filter."""
        params = request.GET.copy()
        params.pop(var, None)
        params.pop(PAGE_VAR, None)  # another filter's rows start at the first page
        choices = [(_g("All"), f"?{params.urlencode()}", chosen is None)]
        for value, display in values:
            params[var] = value
            choices.append((str(display), f"?{params.urlencode()}", value == chosen))
        return choices

    def _post_force_release(self, request: HttpRequest) -> HttpResponse:
        chosen = [
            choice for value in request.POST.getlist(SELECTED_VAR) if (choice := _parse_choice(value)) is not None
        ]
        back = HttpResponseRedirect(request.get_full_path())
        if not chosen:
            self.message_user(request, _g("Tick the locks to force-release first."), messages.WARNING)
            return back
        if request.POST.get(CONFIRM_VAR) != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": _g("Are you sure?"),
                "subtitle": None,
                "opts": self.opts,
                "app_label": self.opts.app_label,
                "chosen": [(json.dumps(list(choice)), _label(*choice)) for choice in chosen],
                "selected_var": SELECTED_VAR,
                "back_url": request.get_full_path(),
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(request, self.force_release_confirmation_template, context)
        self.force_release_locks(request, chosen)
        return back

    def force_release_locks(self, request: HttpRequest, chosen: Sequence[Choice]) -> None:
        """Force-release each (alias, name, token, kind) still held with that token; log and report each.

        The server frees a lock only if it still has the chosen token: one
        released and taken again since the page was shown stays with its new
        holder. A read-write lock's holders are released one by one.
        """
        current: dict[str, list[LockInfo]] = {}
        for alias, name, token, kind in chosen:
            label = _label(alias, name, token, kind)
            try:
                if alias not in current:  # who held it, for the log and the messages
                    held = held_locks([alias])
                    if alias in held.errors:
                        raise LockError(held.errors[alias], alias=alias)
                    current[alias] = held.locks
                # A read-write lock's holders are rows of one name: the kind tells the side.
                rw_side = kind if kind in READ_WRITE else None
                same = [
                    info
                    for info in current[alias]
                    if info.key == name and (info.kind if info.kind in READ_WRITE else None) == rw_side
                ]
                info = next((info for info in same if info.token == token), same[0] if same else None)
                released = info is not None and force_release(alias, name, token, kind=kind)
            except (ImproperlyConfigured, LockError) as exc:
                self.message_user(
                    request,
                    _g("“%(lock)s” could not be released: %(error)s") % {"lock": label, "error": exc},
                    messages.ERROR,
                )
                continue
            if info is not None and released:
                self.log_force_release(request, info)
                self.message_user(
                    request,
                    _g("Force-released “%(lock)s” (held by %(owner)s). Its holder gets LockLost.")
                    % {"lock": label, "owner": info.owner or "?"},
                    messages.SUCCESS,
                )
            elif info is not None and info.token != token:
                # Released and taken again since the page was shown: that holder is someone else.
                self.message_user(
                    request,
                    _g("“%(lock)s” was released and taken again (token %(token)s) since you chose it: not released.")
                    % {"lock": label, "token": info.token},
                    messages.WARNING,
                )
            else:
                self.message_user(
                    request, _g("“%(lock)s” is no longer held: nothing to release.") % {"lock": label}, messages.WARNING
                )

    def log_force_release(self, request: HttpRequest, info: LockInfo) -> None:
        """Write the force-release of ``info`` to the admin log, under the ``Lock`` content type."""
        # An unsaved Lock carries the content type and the repr; object_id stays empty,
        # since the lock may live in Redis or ZooKeeper and is gone anyway.
        lock = Lock(lock_name=f"{info.alias}: {info.key}")
        message = f"Force-released (held by {info.owner or '?'}, hold count {info.hold_count}, token {info.token})."
        if info.kind in READ_WRITE:
            message = f"Force-released the {info.kind} side's holder (held by {info.owner or '?'}, token {info.token})."
        user_id = request.user.pk
        if user_id is None:  # admin_view lets only staff users in
            raise PermissionDenied
        LogEntry.objects.log_actions(
            user_id=user_id,
            queryset=[lock],
            action_flag=DELETION,
            change_message=message,
            single_object=True,
        )


@admin.register(HeldLock)
class HeldLockAdmin(admin.ModelAdmin):
    """The held-locks page's entry in the sidebar and the app index; the page itself is ``LockAdmin``'s.

    Shown to whoever may see the page: who may view ``Lock`` or force-release locks.
    The proxy model has no permissions of its own, and this admin no pages.
    """

    def get_urls(self) -> list[URLPattern]:
        return []  # LockAdmin.get_urls serves the changelist's name: its held-locks page

    def get_model_perms(self, request: HttpRequest) -> dict[str, bool]:
        return {"add": False, "change": False, "delete": False, "view": self.has_view_permission(request)}

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        try:  # whoever LockAdmin shows the page to
            return self.admin_site.get_model_admin(Lock).has_view_permission(request)
        except NotRegistered:  # no LockAdmin on this site: no page
            return False
