"""`manage.py seed_demo`: the demo admin, team and researcher for `lockstep up`.

Prints the demo's passwords and token; the last line is JSON for scripts. With `--keep FILE`
(`lockstep up` passes var/demo-credentials.json) what it handed out is kept there, and a later
start hands out the same again: a restart neither logs anyone out of the portal (a new
password would end every session of that user) nor piles up a new token per start. A password
the user has changed since is left alone and shown as null; a token revoked or expired since is
replaced. Without the file (deleted, or unreadable) the passwords are set afresh.
"""

import json
import os
import secrets
import tempfile
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.utils import timezone

from teams.actions import do_add_member, do_create_team, do_issue_token
from teams.models import ApiToken, Team, token_digest


def _read_kept(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: hand out fresh ones (and write them below)
    return kept if isinstance(kept, dict) else {}


def _write_kept(path: Path, handed_out: dict) -> None:
    # Secrets: readable by the user who runs the platform only (mkstemp always creates a new
    # 0600 file, never reusing a leftover's mode or following a link), written whole or not at
    # all.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".demo-credentials-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(handed_out, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _kept_token(raw, user) -> bool:
    """Whether `raw` is one of `user`'s tokens, not revoked nor expired."""
    if not isinstance(raw, str):
        return False
    token = ApiToken.objects.filter(digest=token_digest(raw), revoked_at__isnull=True).first()
    return (
        token is not None
        and token.user_id == user.pk
        and (token.expires_at is None or token.expires_at > timezone.now())
    )


def _password(user, kept) -> str | None:
    """The user's demo password: the one handed out before while it still works; None when the
    user has set their own since (left alone); otherwise (a new user, or nothing kept: the file
    is gone) a fresh one, so that the banner always names a way in."""
    if isinstance(kept, str) and user.pk is not None:
        if user.check_password(kept):
            return kept
        if user.has_usable_password():
            return None
    fresh = secrets.token_urlsafe(12)
    user.set_password(fresh)
    return fresh


class Command(BaseCommand):
    help = "Create (or refresh) the demo admin, team 'demo' (quota 4) and researcher 'alice'."

    def add_arguments(self, parser):
        parser.add_argument("--quota", type=int, default=4)
        parser.add_argument(
            "--keep",
            type=Path,
            default=None,
            help="a file that keeps the handed-out passwords and token for the next start",
        )

    def handle(self, quota=4, keep=None, **options):
        kept = _read_kept(keep)
        users = get_user_model()
        admin = users.objects.filter(username="admin").first() or users(username="admin")
        admin_password = _password(admin, kept.get("admin_password"))
        admin.is_staff = admin.is_superuser = True
        admin.save()
        team = Team.objects.filter(name="demo").first() or do_create_team("demo", quota=quota)
        alice = users.objects.filter(username="alice").first() or users(username="alice")
        alice_password = _password(alice, kept.get("alice_password"))
        alice.save()
        do_add_member(team, alice, role="lead")
        token = kept.get("alice_token")
        if not _kept_token(token, alice):
            _, token = do_issue_token(alice, name="demo")
        handed_out = {
            "admin_password": admin_password,
            "alice_password": alice_password,
            "alice_token": token,
        }
        if keep is not None:
            _write_kept(keep, {**kept, **{k: v for k, v in handed_out.items() if v is not None}})
        for who in ("admin", "alice"):
            password = handed_out[f"{who}_password"]
            self.stdout.write(f"{who} password: {password or '(the one you set)'}")
        self.stdout.write(f"alice API token: {token}")
        self.stdout.write(json.dumps(handed_out))
