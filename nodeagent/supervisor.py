"""Launches and supervises the worker processes of the attempts placed on this node.

One process per rank, each in its own session with the launch contract of
docs/agent-protocol.md; polled without blocking, stopped checkpoint-first (SIGTERM, then SIGKILL
to the process group after a deadline) or killed at once (fencing), and asked for a dump of
their stacks (SIGUSR1) when the portal thinks the attempt hangs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from nodeagent import hang_evidence, kill_confirm, orphans, stacks
from nodeagent.container import REMOVE_TIMEOUT_S, ContainerRank, Engine, agent_identity
from nodeagent.container_launch import ContainerLaunch
from nodeagent.contract import (
    build_worker_env,
    expand_command,
    inheritable_env,
    resolve_command,
)
from nodeagent.engine_calls import EngineCalls, StaleSweep
from nodeagent.exit_clock import ExitClock
from nodeagent.launch import session_cpu_seconds
from nodeagent.orphans import WORKERS_FILE
from nodeagent.saves import seed_resume
from nodeagent.telemetry import detect_gpu_kind
from nodeagent.warm_container import DEFAULT_IDLE_S, WarmContainers
from nodeagent.workers import AttemptWorkers, RankWorker
from nodeagent.zygote import ForkedWorker, Zygote, ZygoteError, can_fork

logger = logging.getLogger("nodeagent.supervisor")

# Exit codes reported for ranks whose process could not be started, following the shell's
# convention so "command not found" reads the same as it would from a terminal.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126

CPU_READ_EVERY_S = 0.5  # the ranks' CPU use is a heartbeat's figure (one a second)


class WorkerSupervisor:
    """Owns every worker process on this node, keyed by attempt id.

    Nothing here blocks: `poll()` reaps exited workers and enforces stop deadlines and is meant
    to be called often by the agent's loop.
    """

    def __init__(
        self,
        work_dir: str | os.PathLike[str],
        *,
        gpu_kind: str = "cpu",
        base_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
        warm_start: bool = False,
        engine: Engine | None = None,
        node: str = "local",
        pull_policy: str = "if-not-present",
        node_env: Mapping[str, str] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir).resolve()
        self.gpu_kind = detect_gpu_kind(gpu_kind)
        # The container runtime when an engine is given; plain processes (not isolated) else.
        self._log = log or logger
        self._exit_clock = ExitClock()
        self.node_env = dict(node_env or {})
        self.engine = engine
        self.node = node
        # Engine calls that can block run off the loop (removals, kills, stale containers).
        self._calls = EngineCalls()
        # Warm containers: a job's container outlives its attempt for a fast restart here.
        self._warm = (
            WarmContainers(
                engine,
                self.work_dir / "jobs",
                idle_s=float(os.environ.get("LOCKSTEP_WARM_CONTAINER_IDLE_S", DEFAULT_IDLE_S)),
                log=self._log,
                calls=self._calls,
            )
            if engine is not None and warm_start
            else None
        )
        self._containers = (
            None
            if engine is None
            else ContainerLaunch(
                engine,
                node=node,
                gpu_kind=self.gpu_kind,
                pull_policy=pull_policy,
                agent_env=os.environ if base_env is None else base_env,
                log=self._log,
                auth_dir=self.work_dir / "registry-auth",
                node_env=self.node_env,
                agent=agent_identity(self.work_dir),
                warm=self._warm,
                calls=self._calls,
            )
        )
        self._base_env = base_env
        self._clock = clock
        self._cpu_read_at = -CPU_READ_EVERY_S
        self._attempts: dict[int, AttemptWorkers] = {}
        # This agent's containers that serve nothing it holds (nodeagent/engine_calls.py).
        self._sweep: StaleSweep | None = None
        if engine is not None:
            agent, held = agent_identity(self.work_dir), self._attempts.keys
            self._sweep = StaleSweep(engine, agent, self._calls, self._log, held, self._warm)
        # Warm start (nodeagent/zygote.py): workers forked from a process that has imported
        # torch already; started now, so it is warm before the first job arrives.
        self._zygote: Zygote | None = None
        # Zygotes replaced after a deploy that still parent live workers: only a worker's parent
        # learns its exit status, so each is closed once its last worker has exited.
        self._retired: list[Zygote] = []
        if warm_start and engine is None:
            # The zygote never holds what workers may not see, either.
            agent_env = os.environ if base_env is None else base_env
            self._zygote = Zygote(
                env=inheritable_env(agent_env),
                preload=agent_env.get("LOCKSTEP_ZYGOTE_PRELOAD"),
            )
            self._zygote.start()

    # -- queries ---------------------------------------------------------------------------

    def attempt_ids(self) -> list[int]:
        return sorted(self._attempts)

    def get(self, attempt_id: int) -> AttemptWorkers | None:
        return self._attempts.get(attempt_id)

    def __contains__(self, attempt_id: object) -> bool:
        return attempt_id in self._attempts

    def status(self, attempt_id: int) -> list[dict[str, Any]]:
        """Per-rank `{"rank", "pid", "state", "exit_code"[, "exited_at"][, "cpu_s"]}` for the
        heartbeat; `cpu_s`: the CPU seconds a live rank's session used so far (`_read_cpu`)."""
        self._read_cpu()
        return [w.report() for w in self._attempts[attempt_id].workers]

    def _read_cpu(self) -> None:
        """Every live rank's CPU use, for all attempts at once and at most every
        CPU_READ_EVERY_S: one scan of /proc serves a heartbeat's many status() calls."""
        now = time.monotonic()
        if now - self._cpu_read_at < CPU_READ_EVERY_S:
            return
        self._cpu_read_at = now
        plain = {}
        for worker in (w for a in self._attempts.values() for w in a.workers if w.alive):
            if isinstance(worker.popen, ContainerRank):  # its launcher reads it inside
                worker.cpu_s = worker.popen.cpu_s
            elif worker.pid is not None:
                plain[worker.pid] = worker
        for pid, used in session_cpu_seconds(set(plain)).items():
            plain[pid].cpu_s = round(used, 2)

    def all_exited(self, attempt_id: int) -> bool:
        return self._attempts[attempt_id].all_exited

    def attempt_dir(self, attempt_id: int) -> Path:
        return self.work_dir / f"attempt-{attempt_id}"

    # -- launching ---------------------------------------------------------------------------

    def launch(self, attempt_id: int, launch: Mapping[str, Any]) -> AttemptWorkers:
        """Start one worker per entry of `launch["ranks"]`.

        Raises KeyError/ValueError/TypeError on a malformed launch, before spawning anything.
        A rank whose command cannot start is reported exited (127 or 126), its reason logged;
        an OSError part-way (a full disk) is the node's (`_launch_failed`, `refuse`)."""
        if attempt_id in self._attempts:
            raise ValueError(f"attempt {attempt_id} already has workers on this node")
        if launch.get("resume_format") and launch.get("checkpoint_dir"):
            # A framework's own save, laid out where the framework looks (nodeagent/saves.py).
            # A failure leaves the ranks to start without it (LOCKSTEP_RESUME_FROM still names
            # it), never the launch undone.
            try:
                seed_resume(
                    launch["checkpoint_dir"], launch.get("resume_from", ""), launch["resume_format"]
                )
            except OSError as exc:
                self._log.warning("attempt %s: resume save not laid out: %s", attempt_id, exc)
        if self._containers is not None:
            try:
                attempt = self._containers.launch(attempt_id, launch, self.attempt_dir(attempt_id))
            except OSError as exc:  # unregistered, it was launched again every heartbeat
                why = f"launch failed: {type(exc).__name__}: {exc}"
                return self.refuse(attempt_id, launch, {"kind": "health", "message": why})
            self._attempts[attempt_id] = attempt
            return attempt
        command = resolve_command(list(launch["command"]))
        if not command:
            raise ValueError(f"attempt {attempt_id}: empty command")
        base_env = os.environ if self._base_env is None else self._base_env
        attempt_dir = self.attempt_dir(attempt_id)
        # Every rank's environment is built before anything is spawned, so a malformed launch
        # raises here instead of leaving half a gang running.
        planned = []
        for entry in launch["ranks"]:
            rank = int(entry["rank"])
            metrics_path = attempt_dir / f"rank-{rank}.metrics.jsonl"
            env = build_worker_env(
                launch,
                entry,
                attempt_id=attempt_id,
                metrics_path=metrics_path,
                gpu_kind=self.gpu_kind,
                base_env=base_env,
                node_env=self.node_env,
            )
            planned.append(
                RankWorker(
                    rank=rank,
                    local_rank=int(entry["local_rank"]),
                    gpu_index=int(entry.get("gpu_index", entry["local_rank"])),
                    log_path=attempt_dir / f"rank-{rank}.log",
                    metrics_path=metrics_path,
                    popen=None,
                    env=env,
                )
            )
        attempt = AttemptWorkers(attempt_id=attempt_id, launch=dict(launch), dir=attempt_dir)
        self._attempts[attempt_id] = attempt
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
            self._spawn(attempt, command, planned)
            self._write_workers_file(attempt)
        except OSError as exc:
            self._launch_failed(attempt, planned, exc)
            return attempt
        forked = sum(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
        self._log.info(
            "attempt %s: launched ranks %s (pids %s) on %s, %s",
            attempt_id,
            [w.rank for w in attempt.workers],
            [w.pid for w in attempt.workers],
            self.gpu_kind,
            f"{forked} warm (forked from the zygote)" if forked else "cold",
        )
        return attempt

    def _spawn(
        self, attempt: AttemptWorkers, command: list[str], planned: list[RankWorker]
    ) -> None:
        """Start each planned rank, warm (forked from the zygote) where it can be, else as a
        plain process; a rank whose command cannot start is exited (127 or 126)."""
        attempt_id = attempt.attempt_id
        for worker in planned:
            # A fresh start: tails read from offset 0, so stale bytes would be re-shipped.
            worker.metrics_path.unlink(missing_ok=True)
            argv = expand_command(command, worker.env)
            with open(worker.log_path, "wb") as log_file:
                if self._zygote is not None and can_fork(argv, worker.env, self._zygote.env):
                    try:
                        worker.popen = self._zygote.spawn(argv, worker.env, worker.log_path)
                        attempt.workers.append(worker)
                        continue
                    except ZygoteError as exc:
                        self._log.warning("warm start unavailable (%s); starting cold", exc)
                        if str(exc).startswith("stale"):
                            # New code on disk: a new zygote imports it (warm again later).
                            # The old one forks no more but stays until its workers exit.
                            old = self._zygote
                            self._retired.append(old)
                            self._zygote = Zygote(env=old.env, preload=old.preload)
                            self._zygote.start()
                try:
                    worker.popen = subprocess.Popen(
                        argv,
                        env=worker.env,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                    self._exit_clock.watch(worker.popen.pid)
                except OSError as exc:
                    code = _cannot_start_code(exc)
                    log_file.write(f"lockstep agent: cannot start {argv!r}: {exc}\n".encode())
                    worker.state, worker.exit_code = "exited", code
                    worker.exited_at = time.time()
                    self._log.error(
                        "attempt %s rank %s: cannot start %r: %s",
                        attempt_id,
                        worker.rank,
                        argv,
                        exc,
                    )
            attempt.workers.append(worker)

    def _launch_failed(
        self, attempt: AttemptWorkers, planned: list[RankWorker], exc: OSError
    ) -> None:
        """A launch the node broke off half-way (the disk filled up under the attempt's files,
        ...). Half a gang cannot train, and ranks the workers file does not list would escape
        the next agent's fencing: the ranks started are killed, the others never start, and
        the attempt is reported refused by the node's health (`error`; reason in the ranks'
        logs): the node's fault. As the ranks' exit 127 it was the job's ("user error")."""
        why = f"launch failed: {type(exc).__name__}: {exc}"
        self._log.error("attempt %s: %s; killing the ranks started", attempt.attempt_id, why)
        attempt.workers = list(planned)  # those started are its first ones
        attempt.killed = True
        attempt.error = {"kind": "health", "message": why}
        for worker in attempt.workers:
            _note(worker.log_path, f"lockstep agent: {why}")
            if worker.popen is None and worker.alive:
                worker.state, worker.exit_code = "exited", _cannot_start_code(exc)
                worker.exited_at = time.time()
            elif worker.alive:
                self._signal_group(worker, signal.SIGKILL)  # reaped, and reported, by poll()
        kill_confirm.sent(attempt, self._clock())

    # -- polling -----------------------------------------------------------------------------

    def poll(self) -> None:
        """Reap exited workers, SIGKILL the survivors of stops whose deadline passed, and
        follow the kills not yet seen to work (nodeagent/kill_confirm.py)."""
        now = self._clock()
        for attempt in list(self._attempts.values()):
            try:
                if attempt.pending_kill is None or not attempt.pending_kill.given_up:
                    self._poll_attempt(attempt, now)
                kill_confirm.follow_up(attempt, now, self._signal_group, self._log, self._calls)
            except Exception as exc:
                # One attempt the agent can no longer watch must not end the loop that watches
                # the others (its end kills every job on the node): that one is given up.
                self._log.exception("attempt %s: polling its workers failed", attempt.attempt_id)
                self.fail(attempt.attempt_id, f"supervising it failed: {type(exc).__name__}: {exc}")
        self._close_retired()
        if self._warm is not None:
            self._warm.tick()  # after the exits above, so an idle container is seen idle now
        if self._sweep is not None:
            self._sweep.tick()

    def _poll_attempt(self, attempt: AttemptWorkers, now: float) -> None:
        if attempt.preparing and self._containers is not None:
            self._containers.poll(attempt)
        # A container whose removal failed may still run its ranks, whatever its client says.
        held = attempt.pending_kill is not None and not attempt.pending_kill.removed
        for worker in attempt.workers:
            if not worker.alive or worker.popen is None or held:
                continue
            code = worker.popen.poll()
            if code is None:
                worker.state = "running"
                continue
            worker.state, worker.exit_code = "exited", code
            # A forked worker's exit time is the zygote's, taken when it reaped it; a
            # Popen child's is the exit clock's, which watches while this loop waits on
            # the portal (this poll's time only if the clock had not looked yet).
            worker.exited_at = (
                getattr(worker.popen, "exited_at", None)
                or self._exit_clock.exited_at(worker.popen.pid)
                or time.time()
            )
            # Leftover children of a finished worker (data loaders, a stray shell) would
            # hold GPU memory the scheduler already considers free. (In a container, the
            # launcher does this.)
            self._signal_group(worker, signal.SIGKILL)
            self._log.info(
                "attempt %s rank %s (pid %s) exited with %s",
                attempt.attempt_id,
                worker.rank,
                worker.pid,
                code,
            )
        if attempt.stop_deadline is not None and now >= attempt.stop_deadline:
            survivors = [w for w in attempt.workers if w.alive]
            if survivors:
                self._log.warning(
                    "attempt %s: stop deadline passed; SIGKILL to ranks %s",
                    attempt.attempt_id,
                    [w.rank for w in survivors],
                )
                kill_confirm.kill(attempt, now, self._signal_group, self._calls)
            attempt.stop_deadline = None
            attempt.killed = attempt.killed or bool(survivors)
        if attempt.all_exited:
            (attempt.dir / WORKERS_FILE).unlink(missing_ok=True)

    def wait(self, attempt_id: int, timeout_s: float, interval_s: float = 0.02) -> bool:
        """Poll until every worker of the attempt exited; False on timeout. For tests/tools."""
        give_up = time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.all_exited(attempt_id):
                return True
            if time.monotonic() >= give_up:
                return False
            time.sleep(interval_s)

    # -- stopping ----------------------------------------------------------------------------

    def stop(self, attempt_id: int, deadline_s: float) -> None:
        """Checkpoint-and-stop: SIGTERM each live worker once; later polls send SIGKILL to the
        process group of any still alive `deadline_s` seconds from now. Repeats are no-ops."""
        attempt = self._attempts[attempt_id]
        if attempt.stopping:
            return
        attempt.stop_deadline = self._clock() + max(0.0, float(deadline_s))
        if attempt.preparing and self._containers is not None:
            self._containers.cancel(attempt, -signal.SIGTERM)  # nothing ran: nothing to save
        if attempt.container is not None:
            # The container's init forwards it to the launcher, which forwards it to each rank.
            # Off the loop: `podman kill` may take its 30 s, as long as the portal's heartbeat
            # timeout, and a stop must not read as a lost node.
            self._calls.signal(attempt.container, signal.SIGTERM)
        for worker in attempt.workers if attempt.container is None else ():
            if worker.alive and worker.popen is not None:
                # Only the worker itself: the trainer turns SIGTERM into "checkpoint at the next
                # step boundary", while its helpers would simply die and break that save.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.popen.pid, signal.SIGTERM)
        self._log.info(
            "attempt %s: SIGTERM sent; SIGKILL in %.1f s if still running", attempt_id, deadline_s
        )

    # -- stack dumps ---------------------------------------------------------------------------

    def dump_stacks(self, attempt_id: int) -> None:
        """Gather the attempt's hang evidence (nodeagent/hang_evidence.py): the ranks' own stack
        dumps, py-spy's from outside, their flight recorders. Once per attempt: heartbeats
        repeat the action, the asking is not repeated."""
        attempt = self._attempts[attempt_id]
        if attempt.dump_sent_at is None:
            attempt.dump_sent_at = self._clock()
            hang_evidence.ask(attempt, self.live_host_pids(attempt_id), self._log, self._calls)

    def refuse(
        self, attempt_id: int, launch: Mapping[str, Any], error: dict[str, str]
    ) -> AttemptWorkers:
        """An attempt this node will not start (its health check failed): no workers, and the
        reason to report."""
        attempt = AttemptWorkers(
            attempt_id=attempt_id,
            launch=dict(launch),
            dir=self.attempt_dir(attempt_id),
            error=error,
        )
        self._attempts[attempt_id] = attempt
        return attempt

    def rank_pids(self, attempt_id: int) -> dict[int, tuple[int | None, int | None]]:
        """rank -> (its pid as it sees itself, its pid on this host, None once it exited) for
        the attempt's started ranks (nodeagent/stacks.rank_pids)."""
        return stacks.rank_pids(self._attempts[attempt_id], self.engine, self._log, self._calls)

    def live_host_pids(self, attempt_id: int) -> dict[int, int]:
        """rank -> host pid of the attempt's live ranks (what py-spy and /proc are given)."""
        return {
            rank: host for rank, (_, host) in self.rank_pids(attempt_id).items() if host is not None
        }

    def dump_settled(self, attempt_id: int) -> bool:
        """True once the hang evidence asked for is written (or has had its time)."""
        return hang_evidence.settled(self._attempts[attempt_id], self._clock())

    def kill(self, attempt_id: int) -> None:
        """SIGKILL every worker's process group now (fencing, shutdown); later polls do it
        again until the kill is seen to work (nodeagent/kill_confirm.py)."""
        attempt = self._attempts[attempt_id]
        attempt.killed = True
        attempt.stop_deadline = None
        if attempt.preparing and self._containers is not None:
            self._containers.cancel(attempt, -signal.SIGKILL)
        if attempt.all_exited:
            return
        kill_confirm.kill(attempt, self._clock(), self._signal_group, self._calls)

    def fail(self, attempt_id: int, why: str) -> None:
        """Give up an attempt this agent can no longer supervise: its ranks are killed, with
        `why` in their logs, and reported exited (-9) once the kill is seen to work (running
        until then: nodeagent/kill_confirm.py), so the portal ends it. Never raises."""
        attempt = self._attempts[attempt_id]
        self._log.error("attempt %s: %s; its ranks are killed", attempt_id, why)
        try:
            self.kill(attempt_id)
        except Exception:
            self._log.exception("attempt %s: killing its ranks", attempt_id)
            for worker in attempt.workers:
                if worker.alive:
                    self._signal_group(worker, signal.SIGKILL)
        attempt.pull = attempt.image_check = None  # whatever broke is not polled again
        for worker in attempt.workers:
            _note(worker.log_path, f"lockstep agent: {why}")
        try:
            kill_confirm.give_up(attempt, why, self._clock())
        except Exception:
            self._log.exception("attempt %s: confirming its kill", attempt_id)

    def stuck_kills(self, gpus: Iterable[int]) -> list[dict[str, Any]]:
        """Failed health checks that refuse a launch onto `gpus`: some hold ranks whose kill
        is not confirmed after kill_confirm.KILL_CONFIRM_S."""
        return kill_confirm.refusals(self._attempts.values(), gpus, self._clock())

    def _close_retired(self) -> None:
        if not self._retired:
            return
        workers = [w.popen for a in self._attempts.values() for w in a.workers]
        for zygote in list(self._retired):
            if not zygote.has_live(w for w in workers if isinstance(w, ForkedWorker)):
                self._retired.remove(zygote)
                zygote.close()

    def close(self) -> None:
        """Let the zygote and the warm containers go (workers, if any are left, are the
        caller's to kill first), then every container of this agent that is still listed."""
        self._exit_clock.close()
        # The removals under way first, never two at once (each call's subprocesses time out).
        if not self._calls.wait(REMOVE_TIMEOUT_S):
            self._log.error("engine calls still running after %.0f s", REMOVE_TIMEOUT_S)
        if self._warm is not None:
            self._warm.close()
        for zygote in self._retired:
            zygote.close()
        self._retired = []
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._sweep is not None:
            self._sweep.close()

    def kill_all(self) -> int:
        """Kill every attempt's workers; returns how many workers were still alive."""
        alive = 0
        for attempt_id, attempt in list(self._attempts.items()):
            alive += sum(1 for w in attempt.workers if w.alive)
            self.kill(attempt_id)
        return alive

    def forget(self, attempt_id: int) -> None:
        """Drop an attempt whose workers have all exited."""
        attempt = self._attempts[attempt_id]
        if not attempt.all_exited:
            raise ValueError(f"attempt {attempt_id} still has live workers")
        del self._attempts[attempt_id]

    def _signal_group(self, worker: RankWorker, sig: int) -> None:
        if worker.popen is None or isinstance(worker.popen, ContainerRank):
            # A container rank's pid is in the container's namespace: never signal it here.
            return
        # start_new_session made the worker the leader of a group whose id is its pid. Linux
        # does not reuse a pid while it still names a live process group, so this cannot hit
        # a stranger's group while any of the worker's processes remain.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.popen.pid, sig)

    # -- orphans from an earlier agent process -----------------------------------------------

    def _write_workers_file(self, attempt: AttemptWorkers) -> None:
        orphans.write_workers_file(attempt.dir, attempt.workers)

    def remove_stale_containers(self) -> int:
        """At start-up, before anything else: remove every container an earlier agent
        process on this work dir left (it crashed, was killed, or was declared lost and its
        attempts given away), so a zombie never trains beside the attempt that replaced it.
        What the engine could not do now later polls try again, off the loop
        (nodeagent/engine_calls.StaleSweep). Returns how many went."""
        return self._sweep.run_now() if self._sweep is not None else 0

    def sweep_stale_containers(self, keep: Iterable[int]) -> None:
        """The portal says this node is back after being declared lost: every container
        serving no attempt in `keep` (its desired ones) goes, warm ones too, since their jobs
        have moved on; off the loop, logged as it goes. (Those of attempts held here go with
        their fencing, which comes next.)"""
        if self._warm is not None:
            self._warm.moved_on(set(keep))
        if self._sweep is not None:
            self._sweep.request(keep)

    def reap_orphans(self) -> int:
        """SIGKILL the workers an earlier agent process left running on this work dir
        (nodeagent/orphans.py); returns how many were killed."""
        return orphans.kill_orphans(self.work_dir, self._log)


def _cannot_start_code(exc: OSError) -> int:
    return EXIT_NOT_EXECUTABLE if isinstance(exc, PermissionError) else EXIT_NOT_FOUND


def _note(log_path: Path, line: str) -> None:
    """The agent's word in a rank's log, where the portal shows why it ended; best effort."""
    with contextlib.suppress(OSError), open(log_path, "ab") as log_file:
        log_file.write(line.encode() + b"\n")
