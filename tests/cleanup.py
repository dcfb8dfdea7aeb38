"""Between transactional tests, empty only the tables a test wrote to.

Django's ``TransactionTestCase`` flushes every database of a test after it: it
empties every table, then re-creates the content types and permissions through
the ``post_migrate`` signal. On the tests' three databases that costs about
0.7 s a test, while most tests leave nothing behind (a released lock deletes
its row). Here one query per database names the tables that hold rows, and only
those are emptied, with the backend's own flush statements. The content types
and permissions are left alone unless the test changed them; then the database
gets Django's whole flush, as before.
"""

from __future__ import annotations

from django.core.management.color import no_style
from django.db import connections

# What post_migrate writes: kept between tests, compared instead of emptied.
KEPT_TABLES = ("django_content_type", "auth_permission")


class Cleanup:
    def __init__(self, flush) -> None:
        self.flush = flush  # Django's TransactionTestCase._fixture_teardown
        self.tables: dict[str, list[str]] = {}  # alias: the tables emptied between tests
        self.kept: dict[str, tuple] = {}  # alias: the KEPT_TABLES' fingerprint after a whole flush

    def teardown(self, test_case) -> None:
        """In place of ``TransactionTestCase._fixture_teardown``."""
        if test_case.available_apps is not None or test_case.serialized_rollback or test_case.reset_sequences:
            self.flush(test_case)
            return
        whole = []
        for alias in test_case._databases_names(include_mirrors=False):
            if not self.empty_what_was_written(alias):
                whole.append(alias)
        if whole:
            test_case._databases_names = lambda include_mirrors=True: whole  # flush() flushes these alone
            try:
                self.flush(test_case)
            finally:
                del test_case._databases_names
            for alias in whole:
                self.kept[alias] = self.fingerprint(alias)[0]

    def empty_what_was_written(self, alias: str) -> bool:
        """Empty the tables of ``alias`` that hold rows; False if it needs a whole flush instead."""
        if alias not in self.kept:
            return False  # the first time: the fingerprint is taken after Django's own flush
        kept, written = self.fingerprint(alias)
        if kept != self.kept[alias]:
            return False
        if written:
            operations = connections[alias].ops
            operations.execute_sql_flush(operations.sql_flush(no_style(), written, allow_cascade=True))
        return True

    def fingerprint(self, alias: str) -> tuple[tuple, list[str]]:
        """(the KEPT_TABLES' row counts and largest ids, the other tables that hold rows), in one query."""
        connection = connections[alias]
        quote = connection.ops.quote_name
        if alias not in self.tables:
            names = connection.introspection.django_table_names(only_existing=True, include_views=False)
            self.tables[alias] = sorted(set(names) - set(KEPT_TABLES))
        kept = ", ".join(f"(SELECT COUNT(*) FROM {quote(t)}), (SELECT MAX(id) FROM {quote(t)})" for t in KEPT_TABLES)
        queries = [f"SELECT 0, {kept}" if connection.vendor != "mysql" else f"SELECT 0, {kept} FROM DUAL"]
        queries += [
            f"SELECT {i}{', NULL' * 2 * len(KEPT_TABLES)} FROM (SELECT 1 AS x FROM {quote(table)} LIMIT 1) AS t{i}"
            for i, table in enumerate(self.tables[alias], 1)
        ]
        with connection.cursor() as cursor:
            cursor.execute(" UNION ALL ".join(queries))
            rows = cursor.fetchall()
        kept_row = next(row[1:] for row in rows if row[0] == 0)
        return tuple(kept_row), [self.tables[alias][row[0] - 1] for row in rows if row[0]]
