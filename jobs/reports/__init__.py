"""Reports over what the platform recorded: goodput (jobs and teams), reclaim times against
their bound, and GPU-hours per team and week. Read-only; the pages, the API and /metrics
render them."""
