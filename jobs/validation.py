"""Validation of job fields shared by the REST API and the portal's submit form."""

import re
from pathlib import PurePosixPath
from urllib.parse import urlparse

from django.core.exceptions import ValidationError

from jobs.conf import lockstep_setting
from jobs.models import GPU
from nodeagent.contract import CONTRACT_NAMES

# A container reference: [registry[:port]/]path[:tag][@sha256:digest], lower-case path parts.
IMAGE_RE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[a-f0-9]{64})?$"
)
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The launch contract: a job's env may not override what the agent sets for every worker (one
# list, the agent's: nodeagent/contract.py is plain Python, as the checkpoint layout is).
RESERVED_ENV = CONTRACT_NAMES
MAX_COMMAND_ITEMS = 256


def image_registry(value: str) -> str:
    """The registry an image reference names, as engines read it: the first path part when
    it looks like a host (a dot, a port, or localhost), else Docker Hub."""
    first, slash, _rest = value.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def validate_image(value: str) -> str:
    if not value or len(value) > 255 or not IMAGE_RE.match(value):
        raise ValidationError(
            "Enter a container image reference such as 'lockstep/trainer:latest' or "
            "'registry.example.com:5000/team/image@sha256:<digest>'."
        )
    allowed = lockstep_setting("IMAGE_REGISTRIES")
    if allowed and image_registry(value) not in allowed:
        raise ValidationError(
            f"Images from {image_registry(value)} are not allowed on this cluster; use one of "
            f"the registries {', '.join(allowed)}."
        )
    return value


def validate_command(value) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValidationError("Command must be a non-empty list of strings (an argv list).")
    if len(value) > MAX_COMMAND_ITEMS:
        raise ValidationError(f"Command may have at most {MAX_COMMAND_ITEMS} items.")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValidationError(f"Command item {i} is {type(item).__name__}, not a string.")
        if "\x00" in item:
            raise ValidationError(f"Command item {i} contains a NUL byte.")
    if not value[0].strip():
        raise ValidationError("The program (first command item) must not be empty.")
    return value


def validate_dataset(value: str) -> str:
    if not value:
        return value
    if len(value) > 1000:
        raise ValidationError("Dataset URI is longer than 1000 characters.")
    allowed = lockstep_setting("ALLOWED_DATASET_SCHEMES")
    scheme = urlparse(value).scheme
    if scheme not in allowed:
        served = ", ".join(f"{s}://" for s in allowed)
        raise ValidationError(
            (f"This cluster does not serve {scheme}:// datasets; " if scheme else "")
            + f"use one of {served} (for example synthetic://addition or "
            "file:///data/corpus.txt on shared storage)."
        )
    if scheme == "file":
        parsed = urlparse(value)
        path = PurePosixPath(parsed.path)
        # file://../x parses as host "..": only file:///path (or file://localhost/path) names
        # a path on the nodes.
        if parsed.netloc not in ("", "localhost") or not path.is_absolute() or ".." in path.parts:
            raise ValidationError("A file:// dataset must be an absolute path without '..'.")
    return value


def dataset_location(value: str) -> str:
    """Where a dataset URI points on the nodes, as an attempt records it for its lineage: a
    file:// URI's path, normalised (so a model version says which file it learned from even
    if the URI was spelled file://localhost/...); other URIs as given."""
    if value.startswith("file:"):
        return str(PurePosixPath(urlparse(value).path))
    return value


def dataset_mounts(team) -> list[str]:
    """The shared-storage directories a team's jobs get read-only: the cluster's DATASET_ROOTS
    and the team's own dataset paths."""
    return sorted({*lockstep_setting("DATASET_ROOTS"), *(team.dataset_paths if team else [])})


def validate_dataset_for_team(value: str, team) -> str:
    """A file:// dataset must lie under a directory the team's jobs get (when any is set)."""
    roots = dataset_mounts(team)
    if not value.startswith("file:") or not roots:
        return value
    path = PurePosixPath(urlparse(value).path)
    if not any(path.is_relative_to(root) for root in roots):
        raise ValidationError(
            f"{path} is not on shared storage this team's jobs can read; datasets must lie "
            f"under {', '.join(roots)}."
        )
    return value


def validate_dataset_paths(value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ValidationError("Dataset paths must be a list of absolute directory paths.")
    if len(value) > 32:
        raise ValidationError("A team may have at most 32 dataset paths.")
    for item in value:
        path = PurePosixPath(item)
        if (
            not path.is_absolute()
            or ".." in path.parts
            or len(item) > 1000
            or path == PurePosixPath("/")
        ):
            raise ValidationError(f"{item!r} is not an absolute directory path (not /, no '..').")
    return sorted(set(value))


def validate_env(value) -> dict[str, str]:
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise ValidationError("Env must be an object of NAME: value strings.")
    if len(value) > 128:
        raise ValidationError("Env may have at most 128 variables.")
    for name, item in value.items():
        if not ENV_NAME_RE.match(name):
            raise ValidationError(f"{name!r} is not a valid environment variable name.")
        if name in RESERVED_ENV or name.startswith("LOCKSTEP_"):
            raise ValidationError(
                f"{name} is set by Lockstep's launch contract; do not override it."
            )
        if not isinstance(item, str):
            raise ValidationError(f"Env value of {name} must be a string.")
    return value


def cluster_gpu_count() -> int:
    return GPU.objects.count()


def validate_min_gpus(min_gpus: int | None, gpus: int) -> None:
    """An elastic job's floor: at least 1 and at most its GPU count. The scheduler starts it on
    a divisor of gpus not below min_gpus, so say so when there is none but gpus itself."""
    if min_gpus is None:
        return
    if min_gpus < 1:
        raise ValidationError("min_gpus must be at least 1.")
    if min_gpus > gpus:
        raise ValidationError(f"min_gpus ({min_gpus}) must not exceed gpus ({gpus}).")


def validate_gpus(gpus: int, team) -> None:
    """GPU count within the cluster and the team's quota plus borrow limit."""
    if gpus < 1:
        raise ValidationError("A job needs at least 1 GPU.")
    total = cluster_gpu_count()
    if gpus > total:
        raise ValidationError(f"The cluster has {total} GPUs; this job asks for {gpus}.")
    if team is not None and gpus > team.gpu_cap:
        raise ValidationError(
            f"Team {team.name} may use at most {team.gpu_cap} GPUs "
            f"(quota {team.quota} + borrow limit {team.borrow_limit})."
        )
