"""Bulk INSERTs from plain tuples, for the heartbeat's hot path (metric points and their rollup
buckets), and bulk reads of many timestamps, for the scheduler's snapshot (`read_rows`).

`bulk_create` builds and prepares a model instance per row, which cost more CPU than the
database did. Instead:

- PostgreSQL: one `INSERT ... SELECT * FROM unnest(%s::type[], ...)`, one array parameter per
  column. The statement's text is the same whatever the number of rows, so the driver parses
  it once (psycopg's client-side binding re-parses every new text: a multi-row VALUES list of
  a few hundred rows cost more than the insert), and the server runs one statement, where
  `executemany` runs one per row.
- SQLite: `executemany`, which steps one prepared statement per row inside the library.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence

import psycopg
from django.db import connection, models


def insert_rows(
    model: type[models.Model],
    columns: Sequence[str],
    rows: Sequence[tuple],
    *,
    conflict: Sequence[str] = (),
    update: Sequence[str] = (),
    merge: dict[str, str] | None = None,
) -> None:
    """INSERT the rows (values in `columns` order, database-ready); with `conflict` (a unique
    key's columns) and `update`, an upsert that overwrites the `update` columns of a row
    already there (`ON CONFLICT ... DO UPDATE`, which PostgreSQL and SQLite 3.24+ share).
    `merge` (column -> "min", "max" or "sum") instead combines the row there with the new
    one, in the database: concurrent upserts of one row then add up, none is lost."""
    if not rows:
        return
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    head = f"INSERT INTO {table} ({', '.join(map(quote, columns))}) "
    tail = ""
    if conflict:
        pg = connection.vendor == "postgresql"
        how = {
            "min": "LEAST({old}, {new})" if pg else "MIN({old}, {new})",
            "max": "GREATEST({old}, {new})" if pg else "MAX({old}, {new})",
            "sum": "{old} + {new}",
        }
        sets = [
            how[merge[c]].format(old=f"{table}.{quote(c)}", new=f"excluded.{quote(c)}")
            if merge and c in merge
            else f"excluded.{quote(c)}"
            for c in update
        ]
        tail = f" ON CONFLICT ({', '.join(map(quote, conflict))}) DO UPDATE SET " + ", ".join(
            f"{quote(c)} = {value}" for c, value in zip(update, sets, strict=True)
        )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            fields = {field.column: field for field in model._meta.concrete_fields}
            arrays = ", ".join(f"%s::{fields[c].db_type(connection)}[]" for c in columns)
            cursor.execute(
                f"{head}SELECT * FROM unnest({arrays}){tail}",
                [list(values) for values in zip(*rows, strict=True)],
            )
        else:
            cursor.executemany(
                f"{head}VALUES ({', '.join(['%s'] * len(columns))}){tail}", list(rows)
            )


def read_rows(queryset: models.QuerySet) -> list[tuple]:
    """The rows of a `values_list(..., named=True)` query, as the ORM gives them, with
    PostgreSQL's timestamps parsed by psycopg's own loader.

    Django loads every `timestamptz` through a Python subclass of psycopg's loader (to attach
    the connection's time zone), which takes the C implementation out of the path: 10,000
    queued jobs' submit times were 0.18 s of a 0.6 s snapshot read at the target's size, and
    psycopg's C loader parses them 11 times faster (bench/snapshot_read.py --profile). The
    session's time zone is UTC (Django sets it with USE_TZ), so the values are the same
    aware datetimes. Only for fields without a `from_db_value` converter (dates, numbers,
    text): nothing else of the ORM runs. Elsewhere, the ORM as it is."""
    if connection.vendor != "postgresql":
        return list(queryset)
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.cursor.adapters.register_loader("timestamptz", _C_TIMESTAMPTZ)
        cursor.execute(sql, params)
        names = [column.name for column in cursor.description]
        rows = cursor.fetchall()
    row = namedtuple("Row", queryset.query.values_select or names)
    return [row(*values) for values in rows]


# Whatever psycopg registered for timestamptz (text): its C loader where psycopg[binary] is in.
_C_TIMESTAMPTZ = psycopg.adapters.get_loader(
    psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT
)
