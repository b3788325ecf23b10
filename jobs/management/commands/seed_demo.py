"""`manage.py seed_demo`: the demo admin, team and researcher for `lockstep up`.

Prints fresh passwords and a token; the last line is JSON for scripts.
"""

import json
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from teams.actions import do_add_member, do_create_team, do_issue_token
from teams.models import Team


class Command(BaseCommand):
    help = "Create (or refresh) the demo admin, team 'demo' (quota 4) and researcher 'alice'."

    def add_arguments(self, parser):
        parser.add_argument("--quota", type=int, default=4)

    def handle(self, quota=4, **options):
        users = get_user_model()
        admin, _ = users.objects.get_or_create(username="admin")
        admin_password = secrets.token_urlsafe(12)
        admin.is_staff = admin.is_superuser = True
        admin.set_password(admin_password)
        admin.save()
        team = Team.objects.filter(name="demo").first() or do_create_team("demo", quota=quota)
        alice, _ = users.objects.get_or_create(username="alice")
        alice_password = secrets.token_urlsafe(12)
        alice.set_password(alice_password)
        alice.save()
        do_add_member(team, alice, role="lead")
        _, token = do_issue_token(alice, name="demo")
        self.stdout.write(f"admin password: {admin_password}")
        self.stdout.write(f"alice password: {alice_password}")
        self.stdout.write(f"alice API token: {token}")
        self.stdout.write(
            json.dumps(
                {
                    "admin_password": admin_password,
                    "alice_password": alice_password,
                    "alice_token": token,
                }
            )
        )
