"""Every state change of jobs, attempts, nodes, checkpoints and model versions, one module per
concept (docs/architecture.md has the map).

One function per change; each runs in a transaction and writes an Event. Views, serializers,
the agent endpoints and the scheduler only validate input and call these. Side effects (waking
the scheduler, websocket pushes, queue work) go out on commit, never before. This face hands
on the state changes so callers write `actions.do_x`; reads live in jobs.queries.
"""

from jobs.actions.attempts import do_end_attempt, do_mark_attempt_running
from jobs.actions.claim import ClaimConflict, ClaimRejected, do_start_attempt, do_start_attempts
from jobs.actions.failures import (
    do_end_finished_attempt,
    do_end_hung_attempt,
    do_flag_straggler,
    do_request_stack_dump,
)
from jobs.actions.heartbeat import do_heartbeat
from jobs.actions.jobs import (
    do_cancel_job,
    do_enforce_time_limit,
    do_requeue_job,
    do_set_job_priority,
    do_submit_job,
)
from jobs.actions.node_health import do_hold_node, do_record_health
from jobs.actions.nodes import (
    do_cordon_node,
    do_mark_node_lost,
    do_node_leaving,
    do_register_node,
    do_release_automatic_cordon,
    do_uncordon_node,
)
from jobs.actions.preemption import (
    do_decide_preemption,
    do_grow_job,
    do_propose_preemption,
    do_withdraw_stale_preemptions,
)
from jobs.actions.quota import do_note_quota_overdue, do_note_quota_overdue_ended
from jobs.actions.registry import do_finish_model_export, do_register_model_version

__all__ = [
    "ClaimConflict",
    "ClaimRejected",
    "do_cancel_job",
    "do_cordon_node",
    "do_decide_preemption",
    "do_end_attempt",
    "do_end_finished_attempt",
    "do_end_hung_attempt",
    "do_enforce_time_limit",
    "do_finish_model_export",
    "do_flag_straggler",
    "do_grow_job",
    "do_heartbeat",
    "do_hold_node",
    "do_mark_attempt_running",
    "do_mark_node_lost",
    "do_node_leaving",
    "do_note_quota_overdue",
    "do_note_quota_overdue_ended",
    "do_propose_preemption",
    "do_record_health",
    "do_register_model_version",
    "do_register_node",
    "do_release_automatic_cordon",
    "do_request_stack_dump",
    "do_requeue_job",
    "do_set_job_priority",
    "do_start_attempt",
    "do_start_attempts",
    "do_submit_job",
    "do_uncordon_node",
    "do_withdraw_stale_preemptions",
]
