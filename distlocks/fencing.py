"""Fencing at the resource: a model row refuses writes from a lock holder older than its last writer.

A lease lock cannot stop a holder that paused past its lease (a GC pause,
SIGSTOP, a VM migration) from writing when it wakes; the resource has to check
the lock's fencing token (Martin Kleppmann, "How to do distributed locking",
2016, https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).
Here the resource is the row: a fenced write is one ``UPDATE ... SET ...,
fence_token = %s WHERE pk = %s AND fence_token <= %s``, so the check and the
write cannot race.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, models, transaction

from distlocks.exceptions import StaleToken

FENCE_FIELD = "fence_token"
_MAX_TOKEN = 2**63 - 1  # a BigIntegerField's largest value


def token_of(fence: object) -> tuple[int, str | None, str | None]:
    """Return (token, lock name, lock alias) of ``fence``: a held lock, or an int token.

    Raise ValueError naming ``fence`` for anything else, LockNotOwned if the
    lock is not held by the calling thread.
    """
    name = alias = None
    if isinstance(fence, int) and not isinstance(fence, bool):
        token: object = fence
    else:
        try:
            token = fence.token  # type: ignore[attr-defined]
        except AttributeError:
            raise ValueError(
                "fence must be a held lock (what `with distlocks.lock(...) as held` gives) "
                f"or its int token, not {type(fence).__name__}"
            ) from None
        name, alias = getattr(fence, "name", None), getattr(fence, "alias", None)
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"fence must carry an int token, not {type(token).__name__}")
    if not 0 <= token <= _MAX_TOKEN:
        raise ValueError(f"fence must be a token between 0 and {_MAX_TOKEN}, not {token}")
    return token, name if isinstance(name, str) else None, alias if isinstance(alias, str) else None


def _stale(
    model: type[models.Model], pk: object, fence: tuple[int, str | None, str | None], current: int
) -> StaleToken:
    token, name, alias = fence
    lock = f" (lock {name!r} on {alias!r})" if name else ""
    return StaleToken(
        f"Stale fencing token {token}{lock} for {model._meta.label} pk={pk!r}: the row was written "
        f"with token {current} by a newer holder; nothing was written",
        name=name,
        alias=alias,
        model=model._meta.label,
        pk=pk,
        token=token,
        current=current,
    )


class FencedModel(models.Model):
    """An abstract model whose rows remember the largest fencing token they were written with.

    ``save(fence=held)`` writes only if the row's ``fence_token`` is not larger
    than the lock's token, and stores the token; otherwise it raises
    StaleToken and writes nothing. A plain ``save()`` is Django's, except that
    it writes ``fence_token`` to an existing row only when ``update_fields``
    names it, so that it cannot lower the fence by accident.
    """

    fence_token = models.BigIntegerField(default=0, editable=False)

    # The fence of the save() in progress, read by _do_update (one instance, one thread).
    _distlocks_fence: tuple[int, str | None, str | None] | None = None

    class Meta:
        abstract = True

    def save(self, *args: Any, fence: object = None, **kwargs: Any) -> None:
        """Save the row; with ``fence`` (a held lock or its token), only if no newer holder wrote it.

        Raise StaleToken (a LockLost), with nothing written, if the row's
        ``fence_token`` is larger than the token. A new row stores the token.
        """
        resolved = None if fence is None else token_of(fence)
        update_fields = kwargs.get("update_fields")
        if resolved is None or (update_fields is not None and not len(update_fields)):
            super().save(*args, **kwargs)  # an empty update_fields saves nothing (Django)
            return
        if update_fields is not None:
            kwargs["update_fields"] = {*update_fields, FENCE_FIELD}
        previous = self.fence_token
        self.fence_token, self._distlocks_fence = resolved[0], resolved
        try:
            super().save(*args, **kwargs)
        except BaseException:
            self.fence_token = previous
            raise
        finally:
            self._distlocks_fence = None

    def _do_update(
        self, base_qs: Any, using: Any, pk_val: Any, values: Any, update_fields: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """Django's UPDATE of one table of the row, fenced in its WHERE clause."""
        fence = self._distlocks_fence
        if not any(field.attname == FENCE_FIELD for field, _, _ in values):
            return super()._do_update(base_qs, using, pk_val, values, update_fields, *args, **kwargs)
        if fence is None:
            if not update_fields or FENCE_FIELD not in update_fields:
                # A plain save writes the fence only when named, so that it cannot lower it by accident.
                values = [value for value in values if value[0].attname != FENCE_FIELD]
            return super()._do_update(base_qs, using, pk_val, values, update_fields, *args, **kwargs)
        while True:
            fenced = base_qs.filter(fence_token__lte=fence[0])
            updated = super()._do_update(fenced, using, pk_val, values, update_fields, *args, **kwargs)
            if updated:
                return updated
            row = base_qs.filter(pk=pk_val)
            if connections[using].in_atomic_block:
                row = row.select_for_update()  # a current read, not an older snapshot (REPEATABLE READ)
            current = row.values_list(FENCE_FIELD, flat=True).first()
            if current is None:
                return updated  # no such row: Django inserts it (with the token)
            if current > fence[0]:
                raise _stale(type(self), pk_val, fence, current)
            # The fence was lowered between the two statements (an unfenced update): try again.


def fenced_update(queryset: models.QuerySet[Any], fence: object, **changes: Any) -> int:
    """Update every row of ``queryset`` with ``changes`` and the token of ``fence``; return how many.

    All or none: if any row was written with a larger token, raise StaleToken
    (a LockLost) naming the first such row, and write nothing. Each row is
    checked and written by the same ``UPDATE``; the rows of a stale write are
    rolled back with it.
    """
    if not isinstance(queryset, models.QuerySet):
        raise ValueError(f"queryset must be a QuerySet, not {type(queryset).__name__}")
    model = queryset.model
    if not issubclass(model, FencedModel):
        raise ValueError(f"queryset must be of a FencedModel, not of {model._meta.label}")
    if FENCE_FIELD in changes:
        raise ValueError(f"changes must not set {FENCE_FIELD}: the fence's token is written there")
    resolved = token_of(fence)
    token = resolved[0]
    # A current read (FOR UPDATE): under REPEATABLE READ a plain one could miss a newer write.
    # Being a query for writing, it also names the database the UPDATE goes to.
    newer = queryset.filter(fence_token__gt=token).select_for_update()
    with transaction.atomic(using=newer.db):
        # Lock the rows first, in one order for every writer, so that fenced updates of
        # overlapping rows queue instead of deadlocking (seen on MariaDB; SQLite: a no-op).
        list(queryset.select_for_update().order_by("pk").values_list("pk", flat=True))
        updated = queryset.filter(fence_token__lte=token).update(**changes, fence_token=token)
        stale = newer.values_list("pk", FENCE_FIELD).first()
        if stale is not None:
            raise _stale(model, stale[0], resolved, stale[1])
    return updated
