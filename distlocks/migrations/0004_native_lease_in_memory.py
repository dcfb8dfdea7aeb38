from django.db import migrations

SEQUENCE = "distlocks_native_token"


def in_memory_leases_and_cached_tokens(apps, schema_editor):
    """On MariaDB: the leases in a MEMORY table, the fencing tokens from a cached sequence.

    A lease ends with its server session, so it needs no redo log: an InnoDB
    write made every acquisition wait for an fsync (about 20x the cost of
    GET_LOCK itself). The tokens must outlive a crash, so they come from a
    sequence, which keeps 1000 values in memory and, after a crash, skips the
    ones it had not written down: they keep growing. MySQL has no sequences and
    keeps the InnoDB table.
    """
    connection = schema_editor.connection
    if connection.vendor != "mysql" or not connection.mysql_is_mariadb:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COALESCE(MAX(AUTO_INCREMENT), 1) FROM information_schema.TABLES"
            " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'distlocks_native_lease'"
        )
        start = int(cursor.fetchone()[0])
    schema_editor.execute(f"CREATE SEQUENCE {SEQUENCE} START WITH {start} CACHE 1000")
    schema_editor.execute("ALTER TABLE distlocks_native_lease ENGINE=MEMORY")


def on_disk_leases(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor == "mysql" and connection.mysql_is_mariadb:
        schema_editor.execute("ALTER TABLE distlocks_native_lease ENGINE=InnoDB")
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    dependencies = [
        ("distlocks", "0003_native_lease"),
    ]

    operations = [
        migrations.RunPython(in_memory_leases_and_cached_tokens, on_disk_leases, atomic=False),
    ]
