"""The tables of one verifier run: a counter row and the log of committed increments.

Each run makes its own two tables (``distlocks_verify_<run>_...``) and drops
them at the end, so runs never clash with each other or with the project's
tables, and the app needs no migration. The models live in a registry of
their own, never in the project's.
"""

from __future__ import annotations

from typing import Any, cast

from django.apps.registry import Apps
from django.db import connections, models

PREFIX = "distlocks_verify_"


def make_models(run: str, *, fenced: bool = False) -> tuple[type[models.Model], type[models.Model]]:
    """Return the (Counter, Write) models of run ``run`` (a short hex string); ``fenced``: a FencedModel counter."""
    if not run.isalnum():
        raise ValueError(f"run must be alphanumeric, not {run!r}")
    registry = Apps()

    def meta(table: str) -> type:
        return type("Meta", (), {"app_label": "distlocks_verify", "apps": registry, "db_table": PREFIX + run + table})

    base: type[models.Model] = models.Model
    if fenced:
        from distlocks.fencing import FencedModel

        base = FencedModel
    counter = type(
        "Counter",
        (base,),
        {"__module__": __name__, "value": models.BigIntegerField(default=0), "Meta": meta("_counter")},
    )
    write = type(
        "Write",
        (models.Model,),
        {
            "__module__": __name__,
            "id": models.BigAutoField(primary_key=True),  # commit order: taken while the counter row is locked
            "process": models.IntegerField(),
            "token": models.BigIntegerField(),
            "value": models.BigIntegerField(),  # what it set the counter to
            "Meta": meta("_writes"),
        },
    )
    return cast(Any, counter), cast(Any, write)


def create(database: str, run: str, *, fenced: bool = False) -> None:
    """Create the run's tables on ``database``, with the counter at 0."""
    counter, write = make_models(run, fenced=fenced)
    with connections[database].schema_editor() as editor:
        editor.create_model(counter)
        editor.create_model(write)
    counter._default_manager.using(database).create(pk=1, value=0)


def drop(database: str, run: str) -> None:
    """Drop the run's tables from ``database``, those that were made."""
    connection = connections[database]
    made = set(connection.introspection.table_names())
    with connection.schema_editor() as editor:
        for model in make_models(run):
            if model._meta.db_table in made:
                editor.delete_model(model)
