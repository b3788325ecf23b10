"""An index by rank for the metric points: a wide job's charts read a few ranks' points
(jobs/metrics_spread.py), and by (job, name, step) alone each such read scanned every rank's.

On PostgreSQL jobs_metricpoint is partitioned (0020): the index is made on the parent, which
makes it on every partition, taking each partition's write lock while it builds (CONCURRENTLY
is not possible on a partitioned table). The rank-0 partition and the raw partitions hold at
most the retention's hours of every rank, so that is minutes at most; a site that cannot stop
ingest that long builds it per partition with CONCURRENTLY first (the parent's CREATE INDEX
then attaches them).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0023_allocation_recorded_step'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='metricpoint',
            index=models.Index(fields=['job', 'name', 'rank', 'step'], name='metricpoint_rank_step'),
        ),
    ]
