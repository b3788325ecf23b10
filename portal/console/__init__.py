"""The admin console: one module per page, every page behind the one access rule of
portal/console/access.py (console_view). Pages render; the figures come from jobs.reports."""
