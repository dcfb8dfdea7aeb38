from django.db import migrations

TABLE = "distlocks_native_lease"


def indexes_on(schema_editor, primary_key):
    """The names of the lease table's primary key (on ``id``), or of its other non-unique indexes (``lock_name``'s LIKE index)."""
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, TABLE)
    if primary_key:
        return [name for name, c in constraints.items() if c["primary_key"]]
    return [name for name, c in constraints.items() if c["index"] and not c["unique"] and not c["primary_key"]]


def hot_updates(apps, schema_editor):
    """On PostgreSQL: let an acquisition rewrite its lock's lease row in place (a HOT update).

    Each acquisition writes a new token into ``id``. While ``id`` was indexed
    (the primary key), every update was a new index entry in all three of the
    table's indexes, and the old ones stayed until a vacuum: an uncontended
    lock's statements slowed as its dead entries piled up. Without an index on
    the columns it changes, PostgreSQL updates the row within its page and
    prunes the old versions itself. The lease is found by its name (unique, the
    upsert's arbiter); the tokens stay unique: they come from a sequence. Half of
    each page is left free for those in-page updates.
    """
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in indexes_on(schema_editor, primary_key=True):
        schema_editor.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT {schema_editor.quote_name(name)}")
    for name in indexes_on(schema_editor, primary_key=False):
        schema_editor.execute(f"DROP INDEX {schema_editor.quote_name(name)}")
    schema_editor.execute(f"ALTER TABLE {TABLE} SET (fillfactor = 50)")


def indexed_tokens(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    like = schema_editor._create_index_name(TABLE, ["lock_name"], suffix="_like")
    schema_editor.execute(f"ALTER TABLE {TABLE} RESET (fillfactor)")
    schema_editor.execute(f"CREATE INDEX {schema_editor.quote_name(like)} ON {TABLE} (lock_name varchar_pattern_ops)")
    schema_editor.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_pkey PRIMARY KEY (id)")


class Migration(migrations.Migration):
    dependencies = [
        ("distlocks", "0006_read_write_hold"),
    ]

    operations = [
        migrations.RunPython(hot_updates, indexed_tokens),
    ]
