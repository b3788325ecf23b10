from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def full_size(apps, schema_editor):
    """Attempts before this migration ran on all of their job's GPUs."""
    Attempt = apps.get_model("jobs", "Attempt")
    Job = apps.get_model("jobs", "Job")
    Attempt.objects.filter(world_size=0).update(
        world_size=Subquery(Job.objects.filter(pk=OuterRef("job_id")).values("gpus")[:1])
    )


class Migration(migrations.Migration):
    dependencies = [("jobs", "0006_metric_rollup")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="min_gpus",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Elastic: when the cluster is short the scheduler may start or restart "
                "the job on fewer GPUs, down to this (a divisor of gpus); empty: always all of "
                "them",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="attempt",
            name="world_size",
            field=models.PositiveIntegerField(
                default=0,
                help_text="Ranks (GPUs) of this attempt: fewer than the job's when shrunk",
            ),
        ),
        migrations.RunPython(full_size, migrations.RunPython.noop),
    ]
