"""One accessor for Lockstep's settings (the LOCKSTEP dict), with the table's defaults
(jobs/settings_table.py)."""

from django.conf import settings

from jobs.settings_table import DEFAULTS


def lockstep_setting(name: str):
    return getattr(settings, "LOCKSTEP", {}).get(name, DEFAULTS[name])
