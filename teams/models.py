"""Tenants: teams with quotas, their members, and the API tokens people automate with."""

import hashlib

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models


class Team(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    quota = models.PositiveIntegerField(default=0, help_text="GPUs guaranteed to the team.")
    borrow_limit = models.PositiveIntegerField(
        default=0, help_text="Extra GPUs the team may use when others leave them idle."
    )
    weight = models.FloatField(default=1.0, validators=[MinValueValidator(0.0)])
    # Directories on shared storage only this team's jobs see, read-only at the same path (on
    # top of the cluster's DATASET_ROOTS); its file:// datasets may lie under them.
    dataset_paths = models.JSONField(default=list, blank=True)
    # Set by cluster admins: the team's jobs run only on nodes that isolate them in containers,
    # never on a "process"-runtime node (jobs.scheduling.isolation).
    isolated_only = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def gpu_cap(self) -> int:
        return self.quota + self.borrow_limit


class RegistryCredential(models.Model):
    """How a team's jobs pull from a private registry: set by cluster admins, handed to an
    agent only inside the launch spec of that team's attempt whose image is on that registry
    (for the pull, in a file only the agent reads), never shown back by the API or pages."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="registry_credentials")
    registry = models.CharField(max_length=255)
    username = models.CharField(max_length=255)
    secret = models.CharField(max_length=4000)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["registry"]
        constraints = [
            models.UniqueConstraint(fields=["team", "registry"], name="one_credential_per_registry")
        ]

    def __str__(self) -> str:
        return f"{self.team.name}@{self.registry}"


class Membership(models.Model):
    class Role(models.TextChoices):
        MEMBER = "member"
        LEAD = "lead"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="one_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


def token_digest(raw: str) -> str:
    # Tokens are long random strings, so a fast hash is enough (no salt/KDF needed, unlike
    # passwords); only the digest is stored.
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100, default="default")
    digest = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=12, help_text="First characters, to recognise it.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...) for {self.user}"
