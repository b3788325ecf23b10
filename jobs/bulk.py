"""Set-based writes the ORM has no fast form for: many rows, each with its own values.

`bulk_set` is `UPDATE t SET f = v.f ... FROM (VALUES (pk, f...), ...) AS v WHERE t.pk = v.pk
[AND t.col = %s ...]`: one statement per batch, a hash join on the database instead of one
round trip per row, and (unlike `QuerySet.bulk_update`'s `CASE WHEN` per row) linear in the
number of rows and cheap to compile. PostgreSQL and SQLite (3.33 and later) both take it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from django.db import connection, models

BATCH = 500


def bulk_set(
    model: type[models.Model],
    fields: Sequence[str],
    rows: Iterable[Sequence],
    *,
    where: dict[str, object] | None = None,
    batch_size: int = BATCH,
) -> int:
    """Set `fields` per row, `rows` being (pk, value per field); only rows also matching
    `where` (field name -> value, equality) change. Returns how many rows changed."""
    rows = list(rows)
    if not rows:
        return 0
    opts = model._meta
    qn = connection.ops.quote_name
    table = qn(opts.db_table)
    targets = [opts.pk] + [opts.get_field(name) for name in fields]
    if connection.vendor == "postgresql":
        # VALUES columns are untyped (NULLs would come back as text): cast each to its column.
        cells = [f"%s::{f.cast_db_type(connection)}" for f in targets]
    elif connection.vendor == "sqlite":
        cells = ["%s"] * len(targets)
    else:
        return _per_row(model, fields, rows, where)
    row_sql = "(" + ", ".join(cells) + ")"
    sets = ", ".join(f"{qn(f.column)} = v.column{i}" for i, f in enumerate(targets[1:], start=2))
    pk = qn(opts.pk.column)
    conditions = [f"{table}.{pk} = v.column1"]
    where_params = []
    for name, value in (where or {}).items():
        field = opts.get_field(name)
        conditions.append(f"{table}.{qn(field.column)} = %s")
        where_params.append(field.get_db_prep_value(value, connection))
    changed = 0
    with connection.cursor() as cursor:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            params = [
                f.get_db_prep_value(value, connection)
                for row in batch
                for f, value in zip(targets, row, strict=True)
            ]
            cursor.execute(
                f"UPDATE {table} SET {sets} FROM (VALUES {', '.join([row_sql] * len(batch))}) "
                f"AS v WHERE {' AND '.join(conditions)}",
                params + where_params,
            )
            changed += cursor.rowcount
    return changed


def _per_row(model, fields, rows, where) -> int:
    changed = 0
    for pk, *values in rows:
        changed += model.objects.filter(pk=pk, **(where or {})).update(
            **dict(zip(fields, values, strict=True))
        )
    return changed
