"""On PostgreSQL, jobs_metricpoint becomes a partitioned table (jobs/metric_store.py): rank 0's
points in a partition kept for the job's life, every other rank's in time partitions that
retention drops whole. The columns, indexes and constraints keep their names and meaning, so
the ORM and Django's migration state see the same table; only the primary key's uniqueness is
no longer a constraint (PostgreSQL asks a partitioned table's unique keys to hold the partition
key), and ids still come from one sequence. Elsewhere (SQLite) nothing changes."""

from django.db import migrations

FORWARD = """
ALTER TABLE jobs_metricpoint RENAME TO jobs_metricpoint_unpartitioned;
CREATE SEQUENCE jobs_metricpoint_part_id_seq;
CREATE TABLE jobs_metricpoint (
    id bigint NOT NULL DEFAULT nextval('jobs_metricpoint_part_id_seq'),
    rank integer NOT NULL CONSTRAINT jobs_metricpoint_rank_check2 CHECK (rank >= 0),
    step integer NOT NULL CONSTRAINT jobs_metricpoint_step_check2 CHECK (step >= 0),
    name varchar(64) NOT NULL,
    value double precision NOT NULL,
    time timestamp with time zone NOT NULL,
    attempt_id bigint NOT NULL,
    job_id bigint NOT NULL
) PARTITION BY LIST ((rank = 0));
ALTER SEQUENCE jobs_metricpoint_part_id_seq OWNED BY jobs_metricpoint.id;
CREATE TABLE jobs_metricpoint_kept PARTITION OF jobs_metricpoint FOR VALUES IN (true);
CREATE TABLE jobs_metricpoint_ranks PARTITION OF jobs_metricpoint FOR VALUES IN (false)
    PARTITION BY RANGE (time);
CREATE TABLE jobs_metricpoint_ranks_default PARTITION OF jobs_metricpoint_ranks DEFAULT;
INSERT INTO jobs_metricpoint (id, rank, step, name, value, time, attempt_id, job_id)
    SELECT id, rank, step, name, value, time, attempt_id, job_id
    FROM jobs_metricpoint_unpartitioned;
SELECT setval('jobs_metricpoint_part_id_seq',
              GREATEST((SELECT max(id) FROM jobs_metricpoint_unpartitioned), 0) + 1, false);
DROP TABLE jobs_metricpoint_unpartitioned;
ALTER TABLE jobs_metricpoint RENAME CONSTRAINT jobs_metricpoint_rank_check2
    TO jobs_metricpoint_rank_check;
ALTER TABLE jobs_metricpoint RENAME CONSTRAINT jobs_metricpoint_step_check2
    TO jobs_metricpoint_step_check;
CREATE INDEX jobs_metric_job_id_c02cb5_idx ON jobs_metricpoint (job_id, name, step);
CREATE INDEX jobs_metricpoint_attempt_id_7237655c ON jobs_metricpoint (attempt_id);
CREATE INDEX jobs_metricpoint_job_id_199713c2 ON jobs_metricpoint (job_id);
ALTER TABLE jobs_metricpoint ADD CONSTRAINT jobs_metricpoint_attempt_id_7237655c_fk_jobs_attempt_id
    FOREIGN KEY (attempt_id) REFERENCES jobs_attempt (id) DEFERRABLE INITIALLY DEFERRED;
ALTER TABLE jobs_metricpoint ADD CONSTRAINT jobs_metricpoint_job_id_199713c2_fk_jobs_job_id
    FOREIGN KEY (job_id) REFERENCES jobs_job (id) DEFERRABLE INITIALLY DEFERRED;
"""


def partition(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FORWARD)
    from django.utils import timezone

    from jobs.metric_store import ensure_partitions

    ensure_partitions(timezone.now())


class Migration(migrations.Migration):
    # The partitions are created outside one big transaction's locks as they are made.
    atomic = True

    dependencies = [("jobs", "0019_backfill_fillers")]

    operations = [migrations.RunPython(partition, migrations.RunPython.noop)]
