"""Reports over what the platform recorded: goodput (jobs and teams), reclaim times against
their bound, and GPU-hours per team and week. Read-only; the pages, the API and /metrics
render them."""

# How far back the reports look unless asked otherwise: the team API's goodput and reclaim
# times, the console's preemptions page and /metrics' goodput window.
REPORT_DAYS = 7
