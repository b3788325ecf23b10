"""Starting an attempt's container: its ranks' environments, the image (pulled in the
background per the job's pull policy), the team's directories, and `podman run`.

The supervisor (nodeagent/supervisor.py) calls `launch()` and then `poll()` as it polls its
processes; nothing here blocks the agent's loop for longer than an `image inspect`, so a pull
of many minutes never silences the node's heartbeats.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodeagent.container import (
    EXIT_ENGINE,
    PULL_POLICIES,
    ContainerAttempt,
    ContainerRank,
    Engine,
    agent_identity,
    container_name,
    prepare_dirs,
    run_argv,
)
from nodeagent.contract import build_worker_env, container_base_env, expand_command
from nodeagent.engine_calls import EngineCalls
from nodeagent.warm_container import WarmAttempt, WarmContainers, warm_key
from nodeagent.workers import AttemptWorkers, Pull, RankWorker

# How long a launch waits for the image's inspect before leaving it to `poll`: well above its
# usual 50 ms, far below the portal's heartbeat timeout (30 s).
INSPECT_WAIT_S = 2.0
# A pull slower than this is given up and fails the job like a refused one.
PULL_TIMEOUT_S = 30 * 60.0


class ContainerLaunch:
    def __init__(
        self,
        engine: Engine,
        *,
        node: str,
        gpu_kind: str,
        pull_policy: str,
        agent_env: Mapping[str, str],
        log: logging.Logger | logging.LoggerAdapter[logging.Logger],
        auth_dir: Path,
        node_env: Mapping[str, str] | None = None,
        agent: str = "",
        warm: WarmContainers | None = None,
        calls: EngineCalls | None = None,
    ) -> None:
        self.agent = agent or agent_identity(auth_dir.parent)
        self.auth_dir = auth_dir
        self.node_env = dict(node_env or {})
        # RDMA: the node's InfiniBand devices go into every container, with the capability
        # to pin memory for them (as Determined's agents do).
        self.infiniband = Path("/dev/infiniband").is_dir()
        self.engine = engine
        self.node = node
        self.gpu_kind = gpu_kind
        self.pull_policy = pull_policy
        self.agent_env = agent_env
        self.log = log
        # Warm containers (nodeagent/warm_container.py): None starts one per attempt.
        self.warm = warm
        # The engine calls that could block the agent's loop run off it (engine_calls.py).
        self.calls = calls or EngineCalls()

    def launch(
        self, attempt_id: int, launch: Mapping[str, Any], attempt_dir: Path
    ) -> AttemptWorkers:
        """The attempt's workers, their container started at once when the image is here and
        the policy allows, else after a background pull (`poll`). A missing image under the
        `never` policy ends every rank with 125 and sets `error` (the job fails at once)."""
        if self.warm is not None:
            # Under the job's directory, which its warm container mounts for every attempt.
            attempt_dir = self.warm.serve_dir(int(launch["job_id"])) / attempt_dir.name
        ranks = sorted(launch["ranks"], key=lambda r: int(r["local_rank"]))
        gpu_indices = sorted(int(r.get("gpu_index", r["local_rank"])) for r in ranks)
        attempt = AttemptWorkers(attempt_id=attempt_id, launch=dict(launch), dir=attempt_dir)
        for entry in ranks:
            rank = int(entry["rank"])
            metrics_path = attempt_dir / f"rank-{rank}.metrics.jsonl"
            env = build_worker_env(
                launch,
                entry,
                attempt_id=attempt_id,
                metrics_path=metrics_path,
                gpu_kind=self.gpu_kind,
                base_env=container_base_env(self.agent_env),
                node_env=self.node_env,
            )
            gpu_index = int(entry.get("gpu_index", entry["local_rank"]))
            if self.gpu_kind == "cuda":
                # Only the allocated GPUs are in the container, numbered from 0 in bus order.
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
                env["CUDA_VISIBLE_DEVICES"] = str(gpu_indices.index(gpu_index))
            worker = RankWorker(
                rank,
                int(entry["local_rank"]),
                gpu_index,
                attempt_dir / f"rank-{rank}.log",
                metrics_path,
                None,
                env=env,
            )
            attempt.workers.append(worker)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        for worker in attempt.workers:
            # A fresh start: tails read from offset 0, so stale bytes would be re-shipped.
            worker.metrics_path.unlink(missing_ok=True)
            worker.log_path.unlink(missing_ok=True)
        image = launch["image"]
        policy = launch.get("image_pull_policy") or self.pull_policy
        if policy not in PULL_POLICIES:
            self.fail(attempt, f"unknown image pull policy {policy!r}")
            return attempt
        # One inspect tells both whether the image is here and which one it is. In a thread: it
        # takes some 50 ms and the start goes on at once, but a wedged engine would take its
        # minute to time out, which `poll` waits for instead of the loop.
        self._inspect(attempt, image)
        return attempt

    def _inspect(self, attempt: AttemptWorkers, image: str) -> None:
        """Start the image's inspect (and its warm preload label, both kept) in a thread; wait
        for it up to INSPECT_WAIT_S and go on (`_checked`) if it answered, else `poll` will."""

        def inspect() -> str:
            digest = self.engine.image_digest(image)
            if digest and self.warm is not None:
                self.warm.preload(image, digest)  # read now, off the loop; `start` reuses it
            return digest

        name = container_name(self.node, self.agent, attempt.attempt_id)
        attempt.image_check = self.calls.start(f"{name} image", f"inspect {image}", inspect)
        if self.calls.settle(attempt.image_check, INSPECT_WAIT_S):
            self._checked(attempt)

    def _checked(self, attempt: AttemptWorkers) -> None:
        """The image's inspect answered: start, pull or fail, as the pull policy says."""
        check, attempt.image_check = attempt.image_check, None
        launch, attempt_id, attempt_dir = attempt.launch, attempt.attempt_id, attempt.dir
        image = launch["image"]
        policy = launch.get("image_pull_policy") or self.pull_policy
        if check.error is not None:  # the engine's fault (a timeout), not the image's
            self.node_failed(attempt, f"cannot inspect image {image}: {check.error}")
            return
        digest = check.result or ""
        present = bool(digest)
        if policy == "never" and not present and not attempt.pulled:
            self.fail(attempt, f"image {image} is not on this node and its pull policy is never")
        elif attempt.pulled or (present and policy != "always"):
            attempt.image_digest = digest  # after a pull: which image it brought
            try:
                self.start(attempt)
            except OSError as exc:  # a full disk under the attempt's files, no engine binary
                self.node_failed(attempt, f"launch failed: {type(exc).__name__}: {exc}")
        else:
            log_path = attempt_dir / "pull.log"
            try:
                auth = self._auth_file(attempt_id, launch.get("registry_auth"))
                with open(log_path, "wb") as out:
                    popen = subprocess.Popen(
                        self.engine.pull_argv(image, auth.parent if auth else None),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            except OSError as exc:  # a full disk, no engine binary: the node's, as above
                self.node_failed(attempt, f"pull failed to start: {type(exc).__name__}: {exc}")
                return
            attempt.pull = Pull(image, popen, log_path, auth_file=auth)
            self.log.info("attempt %s: pulling %s (policy %s)", attempt_id, image, policy)

    def poll(self, attempt: AttemptWorkers) -> None:
        """Carry the image's inspect and a background pull on: start the container once the
        image is here, fail the attempt if it cannot be (or the pull took longer than
        PULL_TIMEOUT_S, or the engine did not answer the inspect within its timeout)."""
        check = attempt.image_check
        if check is not None:
            if check.done:
                self._checked(attempt)
            elif check.overdue():
                attempt.image_check = None
                image = attempt.launch["image"]
                self.node_failed(attempt, f"{self.engine.name} did not answer `image inspect "
                                 f"{image}` in {check.timeout_s:.0f} s")  # fmt: skip
            return
        pull = attempt.pull
        if pull is None:
            return
        code = pull.popen.poll()
        if code is None and pull.elapsed() < PULL_TIMEOUT_S:
            return
        attempt.pull = None
        self._forget_auth(pull)
        attempt.pull_s = pull.elapsed()
        if code is None:
            self._kill_pull(pull)
            self.fail(
                attempt, f"pulling {pull.image} took longer than {PULL_TIMEOUT_S / 60:.0f} min"
            )
        elif code != 0:
            self.fail(attempt, f"cannot pull image {pull.image}: {pull.detail() or 'failed'}")
        else:
            self.log.info(
                "attempt %s: pulled %s in %.1f s", attempt.attempt_id, pull.image, attempt.pull_s
            )
            attempt.pulled = True
            self._inspect(attempt, pull.image)

    def cancel(self, attempt: AttemptWorkers, code: int) -> None:
        """Stopped or fenced while its image was still being inspected or pulled: nothing ever
        ran. (An inspect still running returns to nothing.)"""
        if not attempt.preparing:
            return
        if attempt.pull is not None:
            self._kill_pull(attempt.pull)
            self._forget_auth(attempt.pull)
        attempt.image_check = attempt.pull = None
        for worker in attempt.workers:
            worker.state, worker.exit_code, worker.exited_at = "exited", code, time.time()

    def node_failed(self, attempt: AttemptWorkers, message: str) -> None:
        """The node could not start it (its engine hung, its disk is full): reported refused by
        the node's health, as a launch that raised (supervisor.refuse) is. The portal moves
        the job elsewhere without using a restart and looks at the node, where an image error
        (`fail`) would fail the job."""
        self.log.error("attempt %s: %s", attempt.attempt_id, message)
        attempt.error = {"kind": "health", "message": message}
        for worker in attempt.workers:
            with contextlib.suppress(OSError):  # the full disk it may be about
                worker.log_path.write_text(f"lockstep agent: {message}\n")
            worker.state, worker.exit_code, worker.exited_at = "exited", EXIT_ENGINE, time.time()

    def fail(self, attempt: AttemptWorkers, message: str) -> None:
        self.log.error("attempt %s: %s", attempt.attempt_id, message)
        attempt.error = {"kind": "image", "message": message}
        for worker in attempt.workers:
            worker.log_path.write_text(f"lockstep agent: {message}\n")
            worker.state, worker.exit_code, worker.exited_at = "exited", EXIT_ENGINE, time.time()

    def start(self, attempt: AttemptWorkers) -> None:
        launch, attempt_dir = attempt.launch, attempt.dir
        status_path = attempt_dir / "ranks.json"
        status_path.unlink(missing_ok=True)
        # Each rank's own command: $(NAME) expands to that rank's value (contract.expand_command).
        specs = [
            {
                "rank": w.rank,
                "env": w.env,
                "log": str(w.log_path),
                "command": expand_command(list(launch["command"]), w.env),
            }
            for w in attempt.workers
        ]
        spec = {
            "attempt": attempt.attempt_id,
            "command": launch["command"],
            "status": str(status_path),
            "ranks": specs,
        }
        # The team's uid owns the job's checkpoints and the attempt's directory (the spec in
        # it too: the launcher reads it as the team).
        serve_dir = attempt_dir.parent if self.warm is not None else None
        prepare_dirs(launch, attempt_dir, serve_dir)
        gpus = sorted(w.gpu_index for w in attempt.workers)
        preload = self.warm.preload(launch["image"], attempt.image_digest) if self.warm else ""

        def argv_for(attempt_id: int, spec_path: Path) -> list[str]:
            return run_argv(
                self.engine,
                node=self.node,
                agent=self.agent,
                attempt_id=attempt_id,
                launch=launch,
                attempt_dir=attempt_dir,
                spec_path=spec_path,
                gpu_indices=gpus,
                gpu_kind=self.gpu_kind,
                infiniband=self.infiniband,
                serve_dir=serve_dir,
                preload=preload,
                idle_s=2 * self.warm.idle_s if self.warm is not None else 0,
            )

        def warm_attempt(name: str, popen: subprocess.Popen) -> WarmAttempt:
            return WarmAttempt(
                self.engine,
                name,
                status_path,
                popen,
                serve_dir=serve_dir,
                attempt_id=attempt.attempt_id,
                calls=self.calls,
            )

        name = container_name(self.node, self.agent, attempt.attempt_id)
        uid = os.stat(attempt_dir).st_uid
        if self.warm is not None:
            key = warm_key(argv_for(0, Path()), attempt.image_digest, gpus)
            reused = self.warm.reusable(int(launch["job_id"]), key)
            if reused is not None:
                attempt.container = warm_attempt(reused.container.name, reused.container.popen)
                self.warm.hand_over(reused, attempt, spec, uid)
                self._ranks_in(attempt, launch, "warm container " + reused.container.name)
                return
            self.warm.evict(frozenset(gpus))
            self.warm.request(serve_dir, attempt.attempt_id, spec, uid)
            argv = argv_for(attempt.attempt_id, Path())
        else:
            spec_path = attempt_dir / "launch.json"
            spec_path.write_text(json.dumps(spec))
            with contextlib.suppress(OSError):
                os.chown(spec_path, uid, uid)
            argv = argv_for(attempt.attempt_id, spec_path)
        with open(attempt_dir / "engine.log", "wb") as engine_log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=engine_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self.warm is None:
            attempt.container = ContainerAttempt(
                self.engine, name, status_path, popen, calls=self.calls
            )
        else:
            attempt.container = warm_attempt(name, popen)
            self.warm.add(int(launch["job_id"]), key, frozenset(gpus), attempt)
        self._ranks_in(attempt, launch, f"container {name} started")

    def _ranks_in(self, attempt: AttemptWorkers, launch: Mapping[str, Any], how: str) -> None:
        for worker in attempt.workers:
            worker.popen = ContainerRank(attempt.container, worker.rank)
        self.log.info(
            "attempt %s: %s (%s) for ranks %s",
            attempt.attempt_id,
            how,
            launch["image"],
            [w.rank for w in attempt.workers],
        )

    def _auth_file(self, attempt_id: int, auth: Mapping[str, str] | None) -> Path | None:
        """The team's registry credential as the engine's auth file (`config.json` in a
        directory of its own, as Docker's --config wants it), readable by the agent only,
        outside everything a container mounts; removed when the pull ends."""
        if not auth:
            return None
        self.auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = self.auth_dir / f"attempt-{attempt_id}"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / "config.json"
        token = base64.b64encode(f"{auth['username']}:{auth['password']}".encode()).decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"auths": {auth["registry"]: {"auth": token}}}, out)
        return path

    @staticmethod
    def _forget_auth(pull: Pull) -> None:
        if pull.auth_file is not None:
            pull.auth_file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                pull.auth_file.parent.rmdir()

    @staticmethod
    def _kill_pull(pull: Pull) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pull.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pull.popen.wait(timeout=10)
