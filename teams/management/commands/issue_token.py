"""`manage.py issue_token USERNAME [--team TEAM]`: a new API token, printed as the last line."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from teams.actions import do_add_member, do_create_team, do_issue_token
from teams.models import Membership, Team


class Command(BaseCommand):
    help = "Create the user, team and membership if missing, and print a new API token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--team", help="team to add the user to (created if missing)")
        parser.add_argument("--lead", action="store_true", help="make the user a team lead")
        parser.add_argument(
            "--quota", type=int, default=None, help="quota for a team created here (default 0)"
        )
        parser.add_argument("--name", default="cli", help="a label for the token")
        parser.add_argument(
            "--staff",
            action="store_true",
            help="make the user a cluster admin (for operators and automation)",
        )

    def handle(
        self, username, team=None, lead=False, quota=None, name="cli", staff=False, **options
    ):
        if not username.strip() or len(username) > 150:
            raise CommandError("USERNAME must be 1-150 characters.")
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()
            user.save()
            self.stdout.write(f"created user {username}")
        if staff and not user.is_staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
            self.stdout.write(f"{username} is now a cluster admin")
        if team:
            team_obj = Team.objects.filter(name=team).first()
            if team_obj is None:
                team_obj = do_create_team(team, quota=quota or 0)
                self.stdout.write(f"created team {team} (quota {team_obj.quota})")
            role = Membership.Role.LEAD if lead else Membership.Role.MEMBER
            do_add_member(team_obj, user, role=role)
        _, raw = do_issue_token(user, name=name)
        self.stdout.write(raw)
