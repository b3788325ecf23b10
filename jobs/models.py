"""Nodes, GPUs, jobs, attempts, allocations, checkpoints, metrics, model versions and events.

The words are DESIGN.md's. Two invariants live in the schema itself so that no code path can
break them: a GPU is in at most one live allocation, and a job has at most one live attempt.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q

from jobs.scheduling.vocab import AUTOMATIC_KINDS, PreemptionKind


class Node(models.Model):
    class State(models.TextChoices):
        UP = "up"
        CORDONED = "cordoned"
        DRAINING = "draining"
        DOWN = "down"

    name = models.CharField(max_length=128, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, help_text="Where peers reach it (MASTER_ADDR).")
    rack = models.CharField(max_length=64, default="default")
    gpu_kind = models.CharField(max_length=16, default="cpu")
    state = models.CharField(max_length=16, choices=State.choices, default=State.UP)
    state_reason = models.CharField(max_length=500, blank=True)
    token_digest = models.CharField(max_length=64, blank=True)
    boot_id = models.CharField(max_length=64, blank=True)
    registered_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    telemetry = models.JSONField(default=list, blank=True)
    # When the telemetry was last kept as GpuSample rows (every GPU_SAMPLE_S, not every beat).
    telemetry_sampled_at = models.DateTimeField(null=True, blank=True)
    # Set when the node's current agent process said it is leaving (a planned restart: SIGTERM
    # for an upgrade, Ctrl-C); cleared when an agent registers with a new boot. Its return is
    # then no crash: no strike, and its checkpoint-stopped attempts were requeued, not lost.
    leaving_at = models.DateTimeField(null=True, blank=True)
    # The cordon or drain it was under when it went down (lost, or a planned leave), and why:
    # liveness is not an admin's decision, so it is put back when the node is heard again.
    # Empty: it comes back up.
    held_state = models.CharField(max_length=16, blank=True)
    held_reason = models.CharField(max_length=500, blank=True)
    # How its agent runs jobs: "container" (each job in its own image, isolated; `engine` is
    # podman or docker) or "process" (plain processes of the agent's user: not isolated).
    runtime = models.CharField(max_length=16, default="process")
    engine = models.CharField(max_length=16, blank=True)
    # The agent's latest health check (nodeagent/health_check.py): {"kind", "ok", "checks",
    # "reason", "compute_ms"?}, and when the portal got it.
    health = models.JSONField(default=dict, blank=True)
    health_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def isolated(self) -> bool:
        return self.runtime == "container"


class GPU(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.index}"


class Priority(models.TextChoices):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"
    URGENT = "urgent"


PRIORITY_RANK = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2, Priority.URGENT: 3}


class Job(models.Model):
    class State(models.TextChoices):
        QUEUED = "QUEUED"
        STARTING = "STARTING"
        RUNNING = "RUNNING"
        RESTARTING = "RESTARTING"
        PREEMPTING = "PREEMPTING"
        SUCCEEDED = "SUCCEEDED"
        FAILED = "FAILED"
        CANCELLED = "CANCELLED"

    TERMINAL = (State.SUCCEEDED, State.FAILED, State.CANCELLED)
    LIVE = (State.STARTING, State.RUNNING, State.PREEMPTING)

    name = models.CharField(max_length=100)
    team = models.ForeignKey("teams.Team", on_delete=models.PROTECT, related_name="jobs")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    image = models.CharField(max_length=255)

    class PullPolicy(models.TextChoices):
        IF_NOT_PRESENT = "if-not-present"
        ALWAYS = "always"
        NEVER = "never"

    # When a container-runtime node pulls the image (docs/runtime.md): Kubernetes' policies.
    image_pull_policy = models.CharField(
        max_length=16, choices=PullPolicy.choices, default=PullPolicy.IF_NOT_PRESENT
    )
    command = models.JSONField(help_text="argv list; never passed through a shell")
    dataset = models.CharField(max_length=1000, blank=True)
    gpus = models.PositiveIntegerField()
    min_gpus = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Elastic: when the cluster is short the scheduler may start or restart the job "
        "on fewer GPUs, down to this (a divisor of gpus); empty: always all of them",
    )
    priority = models.CharField(max_length=16, choices=Priority.choices, default=Priority.NORMAL)
    max_restarts = models.PositiveIntegerField(default=3)
    checkpoint_interval_s = models.PositiveIntegerField(null=True, blank=True)
    time_limit_s = models.PositiveIntegerField(null=True, blank=True)
    env = models.JSONField(default=dict, blank=True)

    class Layout(models.TextChoices):
        AUTO = "auto"
        FLAGS = "flags"

    # How the reference trainer spreads the model over the GPUs an attempt gets (given to it
    # as LOCKSTEP_LAYOUT; other scripts ignore it): auto = the planner's choice at every
    # launch, flags = the command's --parallel/--tp/--pp (a command that passes them keeps
    # them either way). trainer/layout.py.
    layout = models.CharField(max_length=8, choices=Layout.choices, default=Layout.AUTO)

    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    reason = models.CharField(max_length=500, blank=True, help_text="Why it waits / how it ended")
    # The scheduler's wait reason as data beside its text: {"code": ..., "data": its numbers}
    # (jobs.scheduling.vocab.WaitReason.to_json); pages render from it, never parse the text.
    # Empty when the reason is not a scheduler's wait (running, ended, just submitted).
    wait = models.JSONField(default=dict, blank=True)
    estimated_start_at = models.DateTimeField(
        null=True, blank=True, help_text="Queued: when the policy, run forward, starts it"
    )
    # The first estimate it was given before it ever started: kept, so that its error is
    # known once it starts (jobs.reports.estimates: the band the estimates have earned).
    promised_start_at = models.DateTimeField(
        null=True, blank=True, help_text="Its first start estimate, kept to measure estimates"
    )
    restart_count = models.PositiveIntegerField(default=0)
    restart_after = models.DateTimeField(null=True, blank=True)
    submitted_at = models.DateTimeField()
    first_started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["state"]), models.Index(fields=["team", "state"])]

    def __str__(self) -> str:
        return f"job {self.id} ({self.name})"

    @property
    def is_terminal(self) -> bool:
        return self.state in self.TERMINAL

    @property
    def priority_rank(self) -> int:
        return PRIORITY_RANK[self.priority]


class Attempt(models.Model):
    class State(models.TextChoices):
        STARTING = "starting"
        RUNNING = "running"
        STOPPING = "stopping"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        LOST = "lost"
        PREEMPTED = "preempted"
        CANCELLED = "cancelled"

    LIVE = (State.STARTING, State.RUNNING, State.STOPPING)

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    world_size = models.PositiveIntegerField(
        default=0, help_text="Ranks (GPUs) of this attempt: fewer than the job's when shrunk"
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.STARTING)
    master_addr = models.CharField(max_length=255)
    master_port = models.PositiveIntegerField()
    resumed_from = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    resumed_from_step = models.PositiveIntegerField(default=0)
    stop_deadline = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    running_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=500, blank=True)
    last_step = models.PositiveIntegerField(default=0)
    first_step_at = models.DateTimeField(null=True, blank=True, help_text="First step record")
    # The step of the first step record (first_step_at's): with the latest one, the pace
    # that projects when the run ends (jobs/progress.py).
    first_step = models.PositiveIntegerField(null=True, blank=True)
    # How many steps the script says the whole run takes (the trainer's `start` or
    # `total_steps` record); None when it does not say.
    total_steps = models.PositiveIntegerField(
        null=True, blank=True, help_text="Steps the script says the whole run takes"
    )
    last_progress_at = models.DateTimeField(null=True, blank=True, help_text="Latest step record")
    # What the platform sees without the script's help (jobs/actions/activity.py): a rank's
    # output or CPU use. Judges progress while the script reports no steps.
    last_activity_at = models.DateTimeField(
        null=True, blank=True, help_text="Latest output or CPU use by any rank"
    )
    failed_at = models.DateTimeField(
        null=True, blank=True, help_text="When the failure happened (ended_at: when detected)"
    )
    # The image the attempt's containers ran (its content id, whatever the tag points to
    # later) and the seconds its pull took; empty under the process runtime.
    image_digest = models.CharField(max_length=128, blank=True)
    pull_s = models.FloatField(null=True, blank=True)
    # Where its dataset was on the nodes (jobs.validation.dataset_location), for lineage.
    dataset_location = models.CharField(max_length=1000, blank=True)
    dump_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="Hang detected: stacks requested before the kill"
    )
    stragglers = models.JSONField(default=list, blank=True, help_text="Ranks flagged slow")
    checkpoint_interval_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="Given to the trainer: the job's or Young/Daly's"
    )
    straggler_checked_at = models.DateTimeField(null=True, blank=True)
    # The trainer's `layout` record (trainer/layout.py): the layout it runs, the planner's
    # per-GPU memory and step-time prediction for it, and the largest of what the ranks
    # measured after their first step ({"chosen": ..., "measured_max": ..., "ranks": n}).
    layout = models.JSONField(default=dict, blank=True)
    filler = models.BooleanField(
        default=False,
        help_text="Started on a reservation's draining nodes past their time (scheduling "
        "rule 4): the reservation's holder stops it, checkpoint-first, once they have drained",
    )

    class Meta:
        ordering = ["job_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_number"),
            # Invariant 3: at most one live attempt per job, whatever races elsewhere.
            models.UniqueConstraint(
                fields=["job"], condition=Q(ended_at__isnull=True), name="one_live_attempt"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number}"

    @property
    def is_live(self) -> bool:
        return self.ended_at is None


class Allocation(models.Model):
    """One GPU held by one attempt, as one rank."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey(GPU, on_delete=models.PROTECT, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    rank = models.PositiveIntegerField()
    local_rank = models.PositiveIntegerField()
    group_rank = models.PositiveIntegerField()
    claimed_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    exited_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # CPU seconds the rank's session had used at its last counted activity (the baseline the
    # next heartbeat's reading is compared with).
    cpu_s = models.FloatField(null=True, blank=True)
    # The highest step of this rank's step records stored (jobs/actions/ingest.py): a record
    # sent again (delivery is at least once) is recognised by it, without reading the job's
    # points of that step, of which a wide gang has one per rank.
    recorded_step = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["attempt_id", "rank"]
        constraints = [
            # Invariant 1: a GPU belongs to at most one live allocation. The claim relies on
            # this index: a concurrent claimer of the same GPU fails on insert and rolls back.
            models.UniqueConstraint(
                fields=["gpu"], condition=Q(released_at__isnull=True), name="gpu_held_once"
            ),
            models.UniqueConstraint(fields=["attempt", "rank"], name="rank_per_attempt"),
        ]
        # Fair share reads the allocations released within its window every pass
        # (scheduling/reader.py): without this index that is a scan of every allocation ever.
        indexes = [models.Index(fields=["released_at"], name="allocation_released_at")]

    def __str__(self) -> str:
        return f"attempt {self.attempt_id} rank {self.rank} on GPU {self.gpu_id}"


class Checkpoint(models.Model):
    class Format(models.TextChoices):
        # The reference trainer's (or trainer.api's) sharded save with its COMMITTED marker.
        DCP = "dcp", "DCP"
        # Saves a framework wrote on its own, seen by the agent (nodeagent/saves.py).
        LIGHTNING = "lightning", "Lightning .ckpt"
        HF = "hf", "Hugging Face checkpoint-N/"
        TORCH = "torch", "torch.save file"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1000)
    bytes = models.BigIntegerField(default=0)
    save_s = models.FloatField(default=0.0)
    created_at = models.DateTimeField()
    preemption = models.BooleanField(
        default=False, help_text="Saved by a checkpoint-and-stop: kept by retention"
    )
    deleted_at = models.DateTimeField(null=True, blank=True, help_text="Pruned by retention")
    format = models.CharField(max_length=16, choices=Format.choices, default=Format.DCP)

    class Meta:
        ordering = ["job_id", "-step"]
        constraints = [models.UniqueConstraint(fields=["job", "path"], name="checkpoint_path")]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step}"


class MetricPoint(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_points")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="+")
    rank = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=64)
    value = models.FloatField()
    time = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["job", "name", "step"]),
            # One rank's points (or a few ranks'): a wide job's chart draws 8 of its 4,096
            # ranks (jobs/metrics_spread.py); by step alone each read scanned every rank.
            models.Index(fields=["job", "name", "rank", "step"], name="metricpoint_rank_step"),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank} step {self.step} {self.name}={self.value}"


class GpuSample(models.Model):
    """One rank's GPU reading, kept from its node's heartbeat every GPU_SAMPLE_S seconds, so
    that a job's GPU use can be charted over the whole run, after it ended too."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="+")
    rank = models.PositiveIntegerField()
    # Epoch seconds, not a DateTimeField: integer division buckets it for a chart the same way
    # on PostgreSQL and SQLite.
    t = models.BigIntegerField()
    util = models.FloatField(null=True)  # percent
    mem_used = models.BigIntegerField(null=True)  # bytes
    mem_total = models.BigIntegerField(null=True)

    class Meta:
        indexes = [models.Index(fields=["job", "t"])]

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank} at {self.t}: {self.util}%"


class LogChunk(models.Model):
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="log_chunks")
    rank = models.PositiveIntegerField()
    text = models.TextField()
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["attempt", "rank"])]

    def __str__(self) -> str:
        return f"attempt {self.attempt_id} rank {self.rank} log"


class ModelVersion(models.Model):
    class ExportState(models.TextChoices):
        PENDING = "pending"
        READY = "ready"
        FAILED = "failed"

    name = models.CharField(max_length=100)
    version = models.PositiveIntegerField()
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.PROTECT, related_name="versions")
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="model_versions")
    step = models.PositiveIntegerField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    created_at = models.DateTimeField()
    notes = models.TextField(blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    export_state = models.CharField(
        max_length=16, choices=ExportState.choices, default=ExportState.PENDING
    )
    export_path = models.CharField(max_length=1000, blank=True)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="model_version")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class Event(models.Model):
    """Append-only audit and timeline row: who or what did what, when, and why."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=64)
    message = models.CharField(max_length=2000)
    job = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    attempt = models.ForeignKey(
        Attempt, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    team = models.ForeignKey(
        "teams.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="events"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            # Alerts and records read by kind over a window (safety stops on the queue page,
            # the reclaim report's overdue owed waits): months of events, a few of the kind.
            models.Index(fields=["kind", "created_at"], name="event_kind_time"),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind}: {self.message}"


class PreemptionRequest(models.Model):
    """A decision to checkpoint-and-stop a running job (the victim) for a queued one.

    Reclaims (a team taking back its quota from borrowers) and starvation claims (scheduling
    rule 4) are approved at once; priority preemptions wait for an admin, and approve
    themselves at `auto_approve_at` so the time a claimant waits stays bounded.
    """

    class Kind(models.TextChoices):
        RECLAIM = PreemptionKind.RECLAIM.value
        PRIORITY = PreemptionKind.PRIORITY.value
        STARVATION = PreemptionKind.STARVATION.value  # waiting many times its length (rule 4)
        BACKFILL = PreemptionKind.BACKFILL.value  # a reservation taking back its fillers (rule 4)

    # Carried out at once, without an admin (the vocabulary's list, which the simulator follows):
    # reclaims give lent GPUs back to their owner, and a starvation claim takes only its own
    # team's or heavier teams' work beyond their quotas.
    AUTOMATIC = tuple(map(Kind, AUTOMATIC_KINDS))

    class State(models.TextChoices):
        PROPOSED = "proposed"
        APPROVED = "approved"
        REJECTED = "rejected"
        EXECUTED = "executed"
        WITHDRAWN = "withdrawn"

    OPEN = (State.PROPOSED, State.APPROVED)

    victim = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="preempted_by")
    claimant = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="preemptions")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PROPOSED)
    reason = models.CharField(max_length=500)
    created_at = models.DateTimeField()
    auto_approve_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    executed_at = models.DateTimeField(null=True, blank=True)
    claimant_started_at = models.DateTimeField(null=True, blank=True)
    work_at_risk_s = models.FloatField(default=0.0, help_text="Since the victim's last checkpoint")

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["victim"],
                condition=Q(state__in=["proposed", "approved"]),
                name="one_open_preemption_per_victim",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} preemption of job {self.victim_id} for job {self.claimant_id}"

    @property
    def reclaim_s(self) -> float | None:
        if self.claimant_started_at is None:
            return None
        return (self.claimant_started_at - self.created_at).total_seconds()


class WhatIfRun(models.Model):
    """An admin's what-if: the platform's recorded jobs of a window replayed by the simulator
    under the current settings and under changed ones (jobs.whatif). Changes nothing else."""

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(help_text="Also the 'now' of the replay")
    since = models.DateTimeField(help_text="Jobs submitted from here ...")
    until = models.DateTimeField(help_text="... to here (exclusive)")
    params = models.JSONField(
        default=dict,
        help_text="Inputs of both runs, current and changed: GPUs, GPUs per node, and per "
        "team quota, borrow limit and weight",
    )
    jobs = models.PositiveIntegerField(default=0, help_text="Jobs submitted in the window")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)
    error = models.CharField(max_length=2000, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"what-if {self.id} ({self.state})"


class MetricRollup(models.Model):
    """One bucket of one rank's metric series on a grid of `width` steps anchored at step 0
    (bucket b holds steps b*width .. (b+1)*width - 1), kept up to date at ingest
    (`jobs/rollup.py`) so a whole-run chart never reads the raw points. Width 0 is the series'
    header (rank 0, bucket 0): its totals over every rank, and the row every change to the
    series' rollup locks first."""

    # No index of its own: the bucket's unique key leads with the job (migration 0025).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    name = models.CharField(max_length=64)
    rank = models.PositiveIntegerField()
    width = models.PositiveIntegerField()
    bucket = models.PositiveIntegerField()
    first_step = models.PositiveIntegerField()
    last_step = models.PositiveIntegerField()
    low = models.FloatField()
    high = models.FloatField()
    count = models.PositiveBigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["job", "name", "width", "rank", "bucket"], name="metric_rollup_bucket"
            )
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} {self.name} rank {self.rank} [{self.width} x {self.bucket}]"
