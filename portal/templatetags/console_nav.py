"""Template helpers for the admin console: `{% console_user user as flag %}` (whether the nav
shows the console: admins, leads) and `{% quota_split used quota as split %}`."""

from django import template

from portal.console.access import is_console_user
from portal.console.teams import quota_split as _quota_split

register = template.Library()


@register.simple_tag
def console_user(user) -> bool:
    return is_console_user(user)


@register.simple_tag
def quota_split(used, quota) -> dict:
    return _quota_split(int(used or 0), int(quota or 0))
