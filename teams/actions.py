"""State changes for teams, memberships and tokens; each writes an Event."""

import secrets
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import transaction

from jobs.event_kinds import EventKind
from jobs.models import Event
from jobs.scheduling.wake import wake_scheduler
from teams.models import ApiToken, Membership, RegistryCredential, Team, token_digest

User = get_user_model()


@transaction.atomic
def do_create_team(
    name: str, *, quota: int = 0, borrow_limit: int = 0, weight: float = 1.0, actor=None
) -> Team:
    team = Team.objects.create(name=name, quota=quota, borrow_limit=borrow_limit, weight=weight)
    Event.objects.create(
        team=team,
        actor=actor,
        kind=EventKind.TEAM_CREATED,
        message=f"team {name} created with quota {quota}, borrow limit {borrow_limit}",
    )
    return team


@transaction.atomic
def do_set_team_quota(
    team: Team,
    *,
    quota: int,
    borrow_limit: int | None = None,
    weight: float | None = None,
    actor=None,
) -> Team:
    before = (team.quota, team.borrow_limit, team.weight)
    team.quota = quota
    if borrow_limit is not None:
        team.borrow_limit = borrow_limit
    if weight is not None:
        team.weight = weight
    team.save(update_fields=["quota", "borrow_limit", "weight"])
    Event.objects.create(
        team=team,
        actor=actor,
        kind=EventKind.TEAM_QUOTA_CHANGED,
        message=(
            f"quota {before[0]} -> {team.quota}, borrow limit {before[1]} -> {team.borrow_limit},"
            f" weight {before[2]} -> {team.weight}"
        ),
        data={"before": list(before), "after": [team.quota, team.borrow_limit, team.weight]},
    )
    transaction.on_commit(lambda: wake_scheduler("quota changed"))
    return team


@transaction.atomic
def do_add_member(team: Team, user, *, role: str = Membership.Role.MEMBER, actor=None):
    membership, created = Membership.objects.get_or_create(
        team=team, user=user, defaults={"role": role}
    )
    if created:
        Event.objects.create(
            team=team,
            actor=actor,
            kind=EventKind.TEAM_MEMBER_ADDED,
            message=f"{user.username} joined {team.name} as {role}",
        )
    return membership


@transaction.atomic
def do_issue_token(
    user, *, name: str = "default", expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    """Create a token; the raw secret is returned once and never stored."""
    raw = "lst_" + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user, name=name, digest=token_digest(raw), prefix=raw[:10], expires_at=expires_at
    )
    Event.objects.create(
        actor=user,
        kind=EventKind.TOKEN_ISSUED,
        message=f"API token {name!r} issued to {user.username}",
    )
    return token, raw


@transaction.atomic
def do_revoke_token(token: ApiToken, *, actor, now: datetime) -> bool:
    """Revoke a token at once; False (and no Event) when it was already revoked."""
    revoked = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now)
    if not revoked:
        return False
    token.revoked_at = now
    Event.objects.create(
        actor=actor,
        kind=EventKind.TOKEN_REVOKED,
        message=f"API token {token.name!r} ({token.prefix}...) of {token.user.username} revoked",
    )
    return True


@transaction.atomic
def do_set_registry_credential(
    team: Team, *, registry: str, username: str, secret: str, actor
) -> RegistryCredential:
    """Set (or replace) the team's credential for one registry. The event names the registry
    and the user, never the secret."""
    credential, created = RegistryCredential.objects.update_or_create(
        team=team, registry=registry, defaults={"username": username, "secret": secret}
    )
    Event.objects.create(
        team=team,
        actor=actor,
        kind=EventKind.TEAM_REGISTRY_CREDENTIAL_SET,
        message=f"{'set' if created else 'replaced'} {team.name}'s credential for {registry} "
        f"(user {username})",
        data={"registry": registry, "username": username},
    )
    return credential


@transaction.atomic
def do_remove_registry_credential(team: Team, *, registry: str, actor) -> bool:
    deleted, _ = RegistryCredential.objects.filter(team=team, registry=registry).delete()
    if deleted:
        Event.objects.create(
            team=team,
            actor=actor,
            kind=EventKind.TEAM_REGISTRY_CREDENTIAL_REMOVED,
            message=f"removed {team.name}'s credential for {registry}",
            data={"registry": registry},
        )
    return bool(deleted)


@transaction.atomic
def do_set_team_dataset_paths(team: Team, *, paths: list[str], actor) -> Team:
    before = list(team.dataset_paths)
    team.dataset_paths = paths
    team.save(update_fields=["dataset_paths"])
    Event.objects.create(
        team=team,
        actor=actor,
        kind=EventKind.TEAM_DATASET_PATHS_CHANGED,
        message=f"{team.name}'s dataset paths: {before or 'none'} -> {paths or 'none'}",
        data={"before": before, "after": paths},
    )
    return team


@transaction.atomic
def do_set_team_isolated_only(team: Team, *, isolated_only: bool, actor) -> Team:
    """Refuse (or allow again) process-runtime nodes for the team's jobs. Running jobs stay
    where they are; from the next pass on, its queued jobs are placed on isolated nodes only."""
    before = team.isolated_only
    team.isolated_only = isolated_only
    team.save(update_fields=["isolated_only"])
    where = "isolated (container) nodes only" if isolated_only else "any node"
    Event.objects.create(
        team=team,
        actor=actor,
        kind=EventKind.TEAM_ISOLATION_CHANGED,
        message=f"{team.name}'s jobs now run on {where}",
        data={"before": before, "after": isolated_only},
    )
    return team
