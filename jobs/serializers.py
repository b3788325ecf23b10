"""REST serializers: they validate and shape data; state changes go through jobs.actions."""

from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils import timezone
from rest_framework import serializers

from jobs import validation
from jobs.checkpoint_policy import checkpoint_advice
from jobs.models import Attempt, Checkpoint, Event, Job, ModelVersion, Node, Priority
from jobs.queries import progress, protection
from jobs.reports.estimates import band_text, recent_estimate_bands
from jobs.reports.goodput import job_goodput
from teams.access import visible_jobs, visible_teams
from teams.models import Team


def _django(fn):
    """Run a jobs.validation check and turn its error into a DRF field error."""

    def run(value):
        try:
            return fn(value)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from exc

    return run


class JobCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    team = serializers.CharField(
        max_length=64,
        required=False,
        help_text="The team it runs under; may be left out by a member of exactly one team.",
    )
    image = serializers.CharField(max_length=255, validators=[_django(validation.validate_image)])
    image_pull_policy = serializers.ChoiceField(
        choices=Job.PullPolicy.choices,
        default=Job.PullPolicy.IF_NOT_PRESENT,
        help_text="When a node pulls the image: if-not-present (default), always (a moving "
        "tag), never (only images already on the nodes).",
    )
    command = serializers.JSONField(validators=[_django(validation.validate_command)])
    dataset = serializers.CharField(
        max_length=1000,
        required=False,
        allow_blank=True,
        default="",
        validators=[_django(validation.validate_dataset)],
    )
    gpus = serializers.IntegerField(min_value=1, max_value=100_000)
    min_gpus = serializers.IntegerField(
        min_value=1,
        max_value=100_000,
        required=False,
        allow_null=True,
        help_text="Elastic: when the cluster is short the job may start or restart on fewer "
        "GPUs, a divisor of gpus not below this; omit for always all of them.",
    )
    priority = serializers.ChoiceField(choices=Priority.choices, default=Priority.NORMAL)
    max_restarts = serializers.IntegerField(min_value=0, max_value=100, default=3)
    checkpoint_interval_s = serializers.IntegerField(min_value=10, required=False, allow_null=True)
    time_limit_s = serializers.IntegerField(min_value=1, required=False, allow_null=True)
    env = serializers.JSONField(
        required=False, default=dict, validators=[_django(validation.validate_env)]
    )
    layout = serializers.ChoiceField(
        choices=Job.Layout.choices,
        default=Job.Layout.AUTO,
        help_text="The reference trainer's layout: auto (the planner's choice for the GPUs each "
        "attempt gets) or flags (the command's --parallel/--tp/--pp); other scripts ignore it.",
    )

    def validate_name(self, value: str) -> str:
        if not value.strip():
            raise serializers.ValidationError("Name must not be blank.")
        return value.strip()

    def validate_team(self, value: str):
        team = visible_teams(self.context["request"].user).filter(name=value).first()
        if team is None:
            # Same message for a team that does not exist and one the user is not in.
            raise serializers.ValidationError(f"Unknown team {value!r}.")
        return team

    def _default_team(self):
        """The submitter's team when they are a member of exactly one (Slurm's default account,
        Determined's default workspace); otherwise the field is required, and says why."""
        user = self.context["request"].user
        teams = list(Team.objects.filter(memberships__user=user).distinct().order_by("name"))
        if len(teams) == 1:
            return teams[0]
        names = [team.name for team in teams]
        if not names:
            raise serializers.ValidationError(
                {"team": ["This field is required: you are a member of no team."]}
            )
        raise serializers.ValidationError(
            {"team": [f"This field is required: you are in teams {', '.join(names)}."]}
        )

    def validate(self, attrs):
        if "team" not in attrs:
            attrs["team"] = self._default_team()
        try:
            validation.validate_gpus(attrs["gpus"], attrs.get("team"))
        except DjangoValidationError as exc:
            raise serializers.ValidationError({"gpus": exc.messages}) from exc
        try:
            validation.validate_min_gpus(attrs.get("min_gpus"), attrs["gpus"])
        except DjangoValidationError as exc:
            raise serializers.ValidationError({"min_gpus": exc.messages}) from exc
        try:
            validation.validate_dataset_for_team(attrs.get("dataset", ""), attrs.get("team"))
        except DjangoValidationError as exc:
            raise serializers.ValidationError({"dataset": exc.messages}) from exc
        return attrs


class AttemptSerializer(serializers.ModelSerializer):
    nodes = serializers.SerializerMethodField()
    ended = serializers.SerializerMethodField()

    class Meta:
        model = Attempt
        fields = [
            "id",
            "number",
            "world_size",
            "state",
            "nodes",
            "resumed_from_step",
            "created_at",
            "running_at",
            "ended_at",
            "ended",
            "last_step",
            "total_steps",
            "image_digest",
            "pull_s",
            "layout",
        ]

    def get_nodes(self, attempt) -> list[str]:
        names = []
        for allocation in attempt.allocations.all():
            if allocation.node.name not in names:
                names.append(allocation.node.name)
        return names

    def get_ended(self, attempt) -> dict | None:
        if attempt.ended_at is None:
            return None
        return {"state": attempt.state, "reason": attempt.end_reason}


class CheckpointSerializer(serializers.ModelSerializer):
    # `attempt` is the attempt's id (as in the attempts list); people count attempts 1, 2, ...
    attempt_number = serializers.IntegerField(source="attempt.number", read_only=True)

    class Meta:
        model = Checkpoint
        fields = [
            "id",
            "job",
            "attempt",
            "attempt_number",
            "step",
            "path",
            "format",
            "bytes",
            "save_s",
            "created_at",
        ]


class JobSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="name", read_only=True)
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "team",
            "owner",
            "image",
            "image_pull_policy",
            "command",
            "dataset",
            "gpus",
            "min_gpus",
            "priority",
            "max_restarts",
            "checkpoint_interval_s",
            "time_limit_s",
            "layout",
            "env",
            "state",
            "reason",
            "estimated_start_at",
            "promised_start_at",
            "restart_count",
            "submitted_at",
            "first_started_at",
            "finished_at",
        ]
        read_only_fields = fields

    def to_representation(self, job):
        data = super().to_representation(job)
        # The scheduler writes estimates only onto queued jobs and leaves the last one behind
        # when a job starts: a start estimate for a job that is not waiting misleads.
        if job.state != Job.State.QUEUED:
            data["estimated_start_at"] = None
        return data


class JobDetailSerializer(JobSerializer):
    attempts = AttemptSerializer(many=True, read_only=True)
    allocation = serializers.SerializerMethodField()
    latest_checkpoint = serializers.SerializerMethodField()
    goodput = serializers.SerializerMethodField()
    checkpoint_policy = serializers.SerializerMethodField()
    protection = serializers.SerializerMethodField()
    estimated_start_band = serializers.SerializerMethodField()
    progress = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = [
            *JobSerializer.Meta.fields,
            "attempts",
            "allocation",
            "latest_checkpoint",
            "goodput",
            "checkpoint_policy",
            "protection",
            "estimated_start_band",
            "progress",
        ]
        read_only_fields = fields

    def get_allocation(self, job) -> list[dict]:
        live = [a for a in job.attempts.all() if a.ended_at is None]
        if not live:
            return []
        return [
            {"node": a.node.name, "gpu": a.gpu.index, "rank": a.rank}
            for a in live[0].allocations.all()
        ]

    def get_latest_checkpoint(self, job) -> dict | None:
        checkpoint = job.checkpoints.order_by("-step", "-id").first()
        return CheckpointSerializer(checkpoint).data if checkpoint else None

    def get_checkpoint_policy(self, job) -> dict:
        return checkpoint_advice(job)

    def get_goodput(self, job) -> dict:
        return job_goodput(job)

    def get_estimated_start_band(self, job) -> str | None:
        """How far `estimated_start_at` can be trusted, as the portal says it ("usually within
        25 min": the band the job's size class has earned, jobs.reports.estimates); null unless
        the job waits with an estimate."""
        if job.state != Job.State.QUEUED or job.estimated_start_at is None:
            return None
        return band_text(job.gpus, recent_estimate_bands(timezone.now())) or None

    def get_progress(self, job) -> dict | None:
        """Its live attempt's step of the run's total and, once its pace is measured, when it
        should end (jobs.progress); null when it runs none or its script gave no total."""
        return progress(job, now=timezone.now())

    def get_protection(self, job) -> dict | None:
        """Its live attempt's minimum run (jobs.scheduling.protection): until when no priority
        or starvation claim may stop it, and its preemptions against the day's safety stop."""
        return protection(job, now=timezone.now())


class JobPatchSerializer(serializers.Serializer):
    priority = serializers.ChoiceField(choices=Priority.choices)


class EventSerializer(serializers.ModelSerializer):
    # allow_null: not every event is about a node, and the OpenAPI schema must say so.
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Event
        fields = ["id", "created_at", "kind", "message", "attempt", "node", "data"]


class ModelVersionSerializer(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    lineage = serializers.SerializerMethodField()

    class Meta:
        model = ModelVersion
        fields = [
            "id",
            "name",
            "version",
            "checkpoint",
            "job",
            "step",
            "created_by",
            "created_at",
            "notes",
            "metrics",
            "export_state",
            "export_path",
            "lineage",
        ]

    def get_lineage(self, version) -> dict:
        job = version.job
        checkpoint = version.checkpoint
        return {
            "job": job.id,
            "job_name": job.name,
            "team": job.team.name,
            "attempt": checkpoint.attempt.number,
            "step": checkpoint.step,
            "dataset": job.dataset,
            "dataset_location": checkpoint.attempt.dataset_location,
            "image": job.image,
            # What the attempt that saved it ran: the tag may have moved since.
            "image_digest": checkpoint.attempt.image_digest,
            "command": job.command,
        }


class ModelVersionCreateSerializer(serializers.Serializer):
    name = serializers.RegexField(
        r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        error_messages={
            "invalid": "Model names use letters, digits, '.', '_' and '-' (at most 100)."
        },
    )
    checkpoint = serializers.IntegerField()
    notes = serializers.CharField(required=False, allow_blank=True, default="", max_length=5000)

    def validate_checkpoint(self, value: int):
        checkpoint = Checkpoint.objects.filter(
            pk=value, job__in=visible_jobs(self.context["request"].user), deleted_at__isnull=True
        ).first()
        if checkpoint is None:
            raise serializers.ValidationError(f"Unknown checkpoint {value}.")
        return checkpoint


class NodeSerializer(serializers.ModelSerializer):
    gpus = serializers.IntegerField(source="gpus.count", read_only=True)

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "address",
            "rack",
            "gpu_kind",
            "state",
            "state_reason",
            "gpus",
            "runtime",
            "engine",
            "last_heartbeat_at",
            # The agent's latest health check: {"kind", "ok", "checks", "reason", "compute_ms"}.
            "health",
            "health_at",
        ]
