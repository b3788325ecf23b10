"""The container runtime: each attempt's local ranks run inside the job's own image.

One container per attempt and node holds all of that node's ranks (as Slurm's pyxis/enroot do),
started by an OCI engine's CLI: podman, or Docker (same command shape). The container gets what
multi-node training needs on bare metal (host network for the rendezvous and NCCL, host IPC,
exactly the allocated GPUs, explicit ulimits) and nothing a job should not see: it runs as the
team's uid with no capabilities, sees only its own job's checkpoint directory and its attempt's
log and metrics directory, and inherits none of the agent's environment. docs/runtime.md has the
whole picture; nodeagent/launch.py is what runs inside.

The supervisor (nodeagent/supervisor.py) treats a container attempt's ranks like processes:
`ContainerRank.poll()` reads the launcher's status file, and signals go to the container, whose
init forwards them to the launcher, which forwards them to the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger("nodeagent.container")

LAUNCHER = Path(__file__).with_name("launch.py")
LAUNCHER_IN_CONTAINER = "/opt/lockstep-agent/launch.py"
# The warm container's fork server uses the zygote's worker set-up (stdlib only, like launch.py).
ZYGOTE = Path(__file__).with_name("zygote.py")
ZYGOTE_IN_CONTAINER = "/opt/lockstep-agent/lockstep_zygote.py"
LABEL = "lockstep.attempt"  # every container the agent starts carries it
# An engine that cannot run the container at all (bad image, refused pull) exits 125, as
# `podman run` and `docker run` do; the ranks are reported with it.
EXIT_ENGINE = 125
ENGINE_TIMEOUT_S = 60.0
REMOVE_TIMEOUT_S = 60.0
# A container whose client exited with ranks the launcher never said ended is removed, and this
# is how often a removal that failed is tried again (ContainerAttempt.confirmed_gone).
GONE_RETRY_S = 5.0
# Container states in which nothing of it runs (podman's and Docker's names).
STOPPED_STATES = ("created", "configured", "exited", "stopped", "dead")
PULL_POLICIES = ("if-not-present", "always", "never")
# A job's processes run as TEAM_UID_BASE + team id: never root, and never the uid of another
# team, so files one team writes are not another's to read.
TEAM_UID_BASE = 200_000
# Upper bounds for the ulimits the container asks for; the agent's own hard limits cap them
# (an unprivileged engine cannot raise a limit above its own).
NOFILE_WANTED = 1_048_576
# (65,536 failed to start here, under a hard limit of 96,362: the engine itself runs with less.)
NPROC_WANTED = 32_768


class EngineError(subprocess.SubprocessError):
    """The engine did not answer a call whose answer the caller needs (`containers`)."""


@dataclass(frozen=True)
class Engine:
    """An OCI engine's CLI. `name` is podman or docker."""

    name: str
    binary: str

    @classmethod
    def detect(cls, wanted: str = "auto") -> Engine | None:
        """The engine to use, or None where none works (the process runtime's case). `auto`
        tries podman, then Docker if its daemon answers (its CLI alone runs nothing)."""
        names = ("podman", "docker") if wanted == "auto" else (wanted,)
        for name in names:
            binary = shutil.which(name)
            if binary is None:
                continue
            engine = cls(name, binary)
            if engine.works():
                return engine
        return None

    def works(self) -> bool:
        """Whether the engine can run containers: podman needs no daemon but a working
        configuration; Docker's CLI answers `info` only with its daemon up."""
        template = "{{.ServerVersion}}" if self.name == "docker" else "{{.Host.OCIRuntime.Name}}"
        try:
            done = self._run(["info", "--format", template], timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def _run(
        self, args: list[str], timeout: float = ENGINE_TIMEOUT_S
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.binary, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    # -- images --------------------------------------------------------------------------------

    def image_present(self, image: str) -> bool:
        return self._run(["image", "inspect", "--format", "{{.Id}}", image]).returncode == 0

    def image_label(self, image: str, label: str) -> str:
        # .Config.Labels: Docker's image inspect has no top-level .Labels (podman's has both).
        done = self._run(
            ["image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}', image]
        )
        value = done.stdout.strip() if done.returncode == 0 else ""
        return "" if value == "<no value>" else value

    def image_digest(self, image: str) -> str:
        """The image's content id (what this attempt ran, whatever its tag points to later)."""
        done = self._run(["image", "inspect", "--format", "{{.Id}}", image])
        if done.returncode != 0:
            return ""
        found = done.stdout.strip()
        return found if found.startswith("sha256:") else f"sha256:{found}"

    # -- containers ----------------------------------------------------------------------------

    def signal(self, name: str, sig: int) -> None:
        sig_name = signal.Signals(sig).name.removeprefix("SIG")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._run(["kill", "--signal", sig_name, name], timeout=30)

    def remove(self, name: str) -> bool:
        """Kill and remove at once (fencing, a stop's deadline, an orphan). True once nothing
        of the container runs: `rm --force` worked, or failed but the engine has the container
        no more or has it stopped. False when the engine did not answer in time or still has
        it: the callers that need it gone try again (nodeagent/kill_confirm.py). (Docker's `rm
        --force` kills at once; it has no `--time`, podman's way to say so.)"""
        wait = ["--time", "0"] if self.name == "podman" else []
        try:
            done = self._run(["rm", "--force", *wait, name], timeout=REMOVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning(
                "%s rm --force %s: no answer in %.0f s", self.name, name, REMOVE_TIMEOUT_S
            )
            return False
        if done.returncode == 0:
            return True
        logger.warning(
            "%s rm --force %s failed (exit %s): %s",
            self.name,
            name,
            done.returncode,
            (done.stderr or "").strip()[-300:],
        )
        return self.stopped(name)

    def stopped(self, name: str) -> bool:
        """Whether nothing of the container runs: the engine has it no more, or has it in a
        state without processes. False when the engine cannot say (it failed or hung)."""
        try:
            done = self._run(
                ["inspect", "--type", "container", "--format", "{{.State.Status}}", name],
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return False
        if done.returncode != 0:
            return "no such" in (done.stderr or "").lower()  # podman's and Docker's words
        return done.stdout.strip() in STOPPED_STATES

    def remove_all(self, agent: str) -> int:
        """Remove every container of this agent identity still listed; how many went. Raises
        EngineError when the engine cannot list them."""
        return sum(self.remove(container["name"]) for container in self.containers(agent))

    def container_pid(self, name: str) -> int | None:
        """The host pid of the container's init (its PID 1), None if it is not running."""
        done = self._run(["inspect", "--format", "{{.State.Pid}}", name], timeout=30)
        value = done.stdout.strip()
        return int(value) if done.returncode == 0 and value.isdigit() and value != "0" else None

    def pull_argv(self, image: str, auth_dir: Path | None) -> list[str]:
        """`pull` with the credential in `auth_dir/config.json` if given: podman takes the
        file (--authfile), Docker its directory (--config, a global option)."""
        if auth_dir is None:
            return [self.binary, "pull", image]
        if self.name == "docker":
            return [self.binary, "--config", str(auth_dir), "pull", image]
        return [self.binary, "pull", "--authfile", str(auth_dir / "config.json"), image]

    def containers(self, agent: str) -> list[dict[str, str]]:
        """Every container started by an agent with this identity (`agent_identity`): this
        agent's and its predecessors' on the same work dir. {"name", "attempt"} each. Raises
        EngineError when the engine fails or does not answer: an empty list would read as
        "none left" (a failing `ps` listed nothing, and stale containers went unremoved)."""
        # Docker's ps gives .Labels as one string, with .Label for one of them; podman's
        # gives a map (and no .Label).
        label = f'.Label "{LABEL}"' if self.name == "docker" else f'index .Labels "{LABEL}"'
        args = ["ps", "--all", "--filter", f"label=lockstep.agent={agent}"]
        try:
            done = self._run([*args, "--format", f"{{{{.Names}}}} {{{{{label}}}}}"])
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"{self.name} ps: no answer in {exc.timeout:.0f} s") from exc
        if done.returncode != 0:
            detail = (done.stderr or "").strip()[-300:]
            raise EngineError(f"{self.name} ps failed (exit {done.returncode}): {detail}")
        found = []
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                found.append({"name": parts[0], "attempt": parts[1]})
        return found


def team_uid(team_id: int) -> int:
    return TEAM_UID_BASE + int(team_id)


def agent_identity(work_dir: Path) -> str:
    """What tells this node's agent's containers from any other's on the same machine: its
    work dir (every agent process on it is the same agent). Two clusters on one machine (a
    `make up` beside the test suite, both with a node "local-a") never touch each other's."""
    return hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:10]


def container_name(node: str, agent: str, attempt_id: int) -> str:
    return f"lockstep-{node}-{agent}-a{attempt_id}"


def _limit(which: int, wanted: int | None) -> str:
    """`wanted` (None: unlimited) capped by the agent's own hard limit, as the engine's
    --ulimit takes it: an engine cannot give a container more than it has itself."""
    _soft, hard = resource.getrlimit(which)
    if hard == resource.RLIM_INFINITY:
        return "-1" if wanted is None else str(wanted)
    return str(hard if wanted is None else min(hard, wanted))


def run_argv(
    engine: Engine,
    *,
    node: str,
    agent: str,
    attempt_id: int,
    launch: Mapping[str, Any],
    attempt_dir: Path,
    spec_path: Path,
    gpu_indices: list[int],
    gpu_kind: str,
    infiniband: bool = False,
    serve_dir: Path | None = None,
    preload: str = "",
    idle_s: float = 600.0,
) -> list[str]:
    """The `podman run` / `docker run` command line of one attempt on this node; with
    `serve_dir`, of a warm container that serves this attempt and the job's next ones on this
    node (nodeagent/warm_container.py): it mounts the job's directory of attempts instead of
    one attempt's."""
    uid = team_uid(launch["team_id"])
    checkpoint_dir = Path(launch["checkpoint_dir"])
    # The job's directory, not the attempt's: a restart resumes from an earlier attempt's
    # save. Other jobs' and other teams' directories are not mounted at all.
    job_checkpoints = checkpoint_dir.parent
    # Unlimited locked memory where the node allows it: RDMA (InfiniBand) registers pinned
    # buffers, and NCCL fails with a low memlock limit.
    memlock = _limit(resource.RLIMIT_MEMLOCK, None)
    nofile = _limit(resource.RLIMIT_NOFILE, NOFILE_WANTED)
    # Given explicitly: once any --ulimit is on the command line, the engine's defaults for the
    # others may exceed what the node allows, and the container fails to start.
    nproc = _limit(resource.RLIMIT_NPROC, NPROC_WANTED)
    argv = [
        engine.binary,
        "run",
        "--rm",
        "--name",
        container_name(node, agent, attempt_id),
        "--label",
        f"lockstep.node={node}",
        "--label",
        f"lockstep.agent={agent}",
        "--label",
        f"{LABEL}={attempt_id}",
        "--label",
        f"lockstep.job={launch['job_id']}",
        "--label",
        f"lockstep.team={launch['team_id']}",
        # Bare-metal networking for the rendezvous and NCCL/gloo; host IPC for NCCL's shared
        # memory transport and DataLoader workers (a 64 MB /dev/shm breaks both).
        "--network",
        "host",
        "--ipc",
        "host",
        # An init as PID 1 forwards SIGTERM/SIGUSR1 to the launcher and reaps zombies.
        "--init",
        "--user",
        f"{uid}:{uid}",
        "--cap-drop",
        "all",
        "--security-opt",
        "no-new-privileges",
        "--ulimit",
        f"nofile={nofile}:{nofile}",
        "--ulimit",
        f"memlock={memlock}:{memlock}",
        "--ulimit",
        f"nproc={nproc}:{nproc}",
        "--pull",
        "never",  # pulled (or refused) before, by ensure_image, with the job's policy
        "--volume",
        f"{job_checkpoints}:{job_checkpoints}:rw",
        "--volume",
        f"{serve_dir or attempt_dir}:{serve_dir or attempt_dir}:rw",
        "--volume",
        f"{LAUNCHER}:{LAUNCHER_IN_CONTAINER}:ro",
    ]
    if serve_dir is not None:
        argv += ["--label", "lockstep.warm=1", "--volume", f"{ZYGOTE}:{ZYGOTE_IN_CONTAINER}:ro"]
    resume = launch.get("resume_from") or ""
    if resume and not Path(resume).resolve().is_relative_to(job_checkpoints):
        argv += ["--volume", f"{resume}:{resume}:ro"]
    # Shared storage the team may read (the cluster's dataset roots and the team's own paths)
    # and the job's dataset, read-only at the same paths, so LOCKSTEP_DATASET and any path a
    # script names mean the same inside and out.
    mounts = [Path(p) for p in launch.get("mounts") or []]
    dataset = dataset_path(launch.get("dataset") or "")
    if dataset is not None and not any(dataset.is_relative_to(m) for m in mounts):
        mounts.append(dataset)
    for mount in mounts:
        if mount.exists():
            argv += ["--volume", f"{mount}:{mount}:ro"]
    if gpu_kind == "cuda":
        if engine.name == "docker":
            argv += ["--gpus", '"device=' + ",".join(str(i) for i in gpu_indices) + '"']
        else:
            # CDI names (nvidia-ctk cdi generate): exactly the allocated devices.
            for index in gpu_indices:
                argv += ["--device", f"nvidia.com/gpu={index}"]
    if infiniband:
        # NCCL over InfiniBand/RoCE: the verbs devices, and IPC_LOCK to register pinned
        # memory with them (the only capability a job gets back).
        argv += ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK"]
    argv += [launch["image"], "python3", LAUNCHER_IN_CONTAINER]
    if serve_dir is None:
        return [*argv, str(spec_path)]
    return [*argv, "--serve", str(serve_dir), "--preload", preload, "--idle-s", f"{idle_s:g}"]


def dataset_path(dataset: str) -> Path | None:
    """The local path a dataset URI names (file:// or a bare absolute path), else None."""
    if dataset.startswith("file://"):
        return Path(urlparse(dataset).path)
    if dataset.startswith("/"):
        return Path(dataset)
    return None


def prepare_dirs(
    launch: Mapping[str, Any], attempt_dir: Path, serve_dir: Path | None = None
) -> None:
    """Owned by the team's uid and closed to everyone else, so the job (not root) can write
    its saves, logs and metrics, and other teams' jobs cannot read them. (`serve_dir`: the
    warm container's directory of the job's attempts, attempt_dir's parent.)"""
    uid = team_uid(launch["team_id"])
    job_checkpoints = Path(launch["checkpoint_dir"]).parent
    job_checkpoints.mkdir(parents=True, exist_ok=True)
    for path in (job_checkpoints, *([serve_dir] if serve_dir else []), attempt_dir):
        os.chown(path, uid, uid)
        path.chmod(0o700)
    for child in job_checkpoints.rglob("*"):
        # Saves of earlier attempts (an earlier runtime may have written them as root).
        with contextlib.suppress(OSError):
            if child.stat().st_uid != uid:
                os.chown(child, uid, uid, follow_symlinks=False)


class ContainerAttempt:
    """One running container and what its launcher last said about its ranks."""

    signals_by_engine = True  # `podman kill --signal`: may block (engine_calls.EngineCalls)

    def __init__(
        self,
        engine: Engine,
        name: str,
        status_path: Path,
        popen: subprocess.Popen,
        calls: Any,
    ) -> None:
        self.engine = engine
        self.name = name
        self.status_path = status_path
        self.popen = popen
        # engine_calls.EngineCalls: where an engine call that may block runs, off the loop.
        self.calls = calls
        self.removed = False  # the engine confirmed it gone (`remove`)
        self._removal: Any = None  # the removal `confirmed_gone` started, while it runs
        self._removal_due = 0.0  # when a failed removal may be tried again; 0: none tried
        self._status: dict[str, Any] = {}
        self._read_at = -1.0

    def status(self, *, fresh: bool = False) -> dict[str, Any]:
        now = time.monotonic()
        if fresh or now - self._read_at >= 0.05:
            self._read_at = now
            with contextlib.suppress(OSError, ValueError):
                self._status = json.loads(self.status_path.read_text())
        return self._status

    def engine_exit(self) -> int | None:
        """The `podman run` client's exit code once the container is gone, else None."""
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        self.engine.signal(self.name, sig)

    def kill(self) -> bool:
        """Its ranks killed; False unless the engine confirmed it (`remove`)."""
        return self.remove()

    def remove(self) -> bool:
        """The container goes, with whatever runs in it; False if the engine did not confirm
        it (the caller tries again: nodeagent/kill_confirm.py)."""
        if not self.engine.remove(self.name):
            return False
        self.removed = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=30)
        return True

    def confirmed_gone(self) -> bool:
        """Whether the container is gone, asked once its `podman run` client exited with a rank
        the launcher never said ended. The client can die alone (killed by hand, by the OOM
        killer) and leave the container running on its GPUs, so the engine removes it first
        (`rm --force`, which holds for one already gone), in a thread (False until it worked;
        tried again every GONE_RETRY_S)."""
        if self.removed:
            return True
        if self._removal is not None and self._removal.done:
            self._removal = None
        now = time.monotonic()
        if self._removal is None and not self.removed and now >= self._removal_due:
            what = f"removing {self.name}: its engine client exited"
            if not self._removal_due:  # the first try
                logger.warning("%s; its ranks are reported killed once it is gone", what)
            self._removal_due = now + GONE_RETRY_S
            self._removal = self.calls.start(self.name, what, self.remove)
        return self.removed


class ContainerRank:
    """One rank inside a container, with the part of Popen's shape the supervisor uses."""

    def __init__(self, container: ContainerAttempt, rank: int) -> None:
        self.container = container
        self.rank = rank
        self.exited_at: float | None = None

    @property
    def pid(self) -> int | None:
        """The rank's pid inside the container's PID namespace (None until it started)."""
        entry = self.container.status().get("ranks", {}).get(str(self.rank))
        return entry.get("pid") if entry else None

    @property
    def cpu_s(self) -> float | None:
        """CPU seconds the rank's session used, as the launcher last read them inside."""
        entry = self.container.status().get("ranks", {}).get(str(self.rank))
        return entry.get("cpu_s") if entry else None

    def poll(self) -> int | None:
        entry = self.container.status().get("ranks", {}).get(str(self.rank))
        if entry and entry.get("state") == "exited":
            self.exited_at = entry.get("exited_at")
            return int(entry["exit_code"])
        engine_exit = self.container.engine_exit()
        if engine_exit is None:
            return None
        # The container is gone and the launcher never said this rank ended: killed with it
        # (a stop's deadline, fencing), or the engine could not start it at all.
        # One last read: the launcher may have written the rank's end just before it exited.
        entry = self.container.status(fresh=True).get("ranks", {}).get(str(self.rank))
        if entry and entry.get("state") == "exited":
            self.exited_at = entry.get("exited_at")
            return int(entry["exit_code"])
        if not self.container.confirmed_gone():
            return None  # running, as far as anyone can tell, until the engine removed it
        if entry is None and engine_exit != 0:
            # The launcher never ran: the engine could not create the container (its reason
            # is in the attempt's engine.log); report the engine's own exit code.
            return engine_exit
        return -signal.SIGKILL
