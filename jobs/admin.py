"""Django admin pages. Mostly read-only: state changes belong to jobs.actions."""

from django.contrib import admin

from jobs.models import (
    GPU,
    Allocation,
    Attempt,
    Checkpoint,
    Event,
    Job,
    LogChunk,
    MetricPoint,
    ModelVersion,
    Node,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ["name", "state", "rack", "address", "gpu_kind", "last_heartbeat_at"]
    list_filter = ["state", "rack"]
    exclude = ["token_digest"]


@admin.register(GPU)
class GPUAdmin(ReadOnlyAdmin):
    list_display = ["node", "index"]


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    can_delete = False
    fields = [
        "number",
        "state",
        "resumed_from_step",
        "last_step",
        "created_at",
        "ended_at",
        "end_reason",
    ]
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "name", "team", "owner", "state", "gpus", "priority", "submitted_at"]
    list_filter = ["state", "team", "priority"]
    search_fields = ["name"]
    inlines = [AttemptInline]


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ["job", "number", "state", "resumed_from_step", "created_at", "ended_at"]
    list_filter = ["state"]


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin):
    list_display = ["attempt", "node", "gpu", "rank", "exit_code", "claimed_at", "released_at"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["job", "step", "bytes", "save_s", "created_at"]


@admin.register(MetricPoint)
class MetricPointAdmin(ReadOnlyAdmin):
    list_display = ["job", "attempt", "rank", "step", "name", "value"]
    list_filter = ["name"]


@admin.register(LogChunk)
class LogChunkAdmin(ReadOnlyAdmin):
    list_display = ["attempt", "rank", "created_at"]


@admin.register(ModelVersion)
class ModelVersionAdmin(ReadOnlyAdmin):
    list_display = ["name", "version", "job", "step", "export_state", "created_by", "created_at"]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "kind", "message", "job", "node", "team", "actor"]
    list_filter = ["kind"]
    search_fields = ["message"]
