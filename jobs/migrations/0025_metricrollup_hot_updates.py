"""The rollups' rows are upserted by every heartbeat (jobs/rollup.py: one row per bucket of
every level, a new version of it for each step): at the default fill factor a page has no room
for the new version, so every update wrote a version on another page and an entry in every
index, and a live run's table held 610 bytes per row (bench/hollow.py, 2026-12-06), which put
the projected storage over its budget. Here:

- PostgreSQL fills new pages to 70 % (`fillfactor`), so an updated version usually fits on its
  own page: a HOT update, with no new index entries, whose dead versions the next access to
  the page prunes without a vacuum. The columns an upsert changes (first and last step, low,
  high, count) are in no index, which HOT needs. Existing pages keep their fill until they are
  rewritten (VACUUM FULL or pg_repack, at a site's leisure).
- The job's own index goes: the bucket's unique key (job, name, width, rank, bucket) leads with
  the job, so deletes by job and the foreign key's checks use that one.
"""

import django.db.models.deletion
from django.db import migrations, models

FILLFACTOR = 70


def fill_pages_partly(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE jobs_metricrollup SET (fillfactor = {FILLFACTOR})")


def fill_pages_wholly(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE jobs_metricrollup RESET (fillfactor)")


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0024_metricpoint_rank_index'),
    ]

    operations = [
        migrations.AlterField(
            model_name='metricrollup',
            name='job',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='jobs.job'),
        ),
        migrations.RunPython(fill_pages_partly, fill_pages_wholly),
    ]
