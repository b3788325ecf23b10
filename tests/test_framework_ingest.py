"""The portal's side of what frameworks write on their own (jobs/actions/ingest.py): TensorBoard
scalars stored as series of their own (activity, never progress), framework saves recorded
with their format and checked on disk, retention leaving them to the framework, the restart's
launch naming the format, and the export of each format (trainer/export.py, real files)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from django.utils import timezone
from safetensors.torch import load_file

from jobs import queries
from jobs.actions.strikes import node_strikes
from jobs.models import Attempt, Checkpoint, Event, MetricPoint
from jobs.scheduling.loop import run_pass
from jobs.tasks import prune_checkpoints
from tests.heartbeats import beat, live_attempt, submit
from trainer.checkpoint_layout import attempt_dir


def _scalar(step, name, value, rank=0):
    return {"kind": "scalar", "rank": rank, "step": step, "name": name, "value": value}


def _running(setup, **fields):
    team, user, (a, b), root = setup
    job = submit(team, user, **{"max_restarts": 2, **fields})
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})
    return job, Attempt.objects.get(pk=attempt.pk), a, root


@pytest.mark.django_db
def test_scalars_are_stored_once_each_and_count_as_activity_not_progress(setup, client):
    job, attempt, a, _ = _running(setup)
    old = timezone.now() - timedelta(minutes=5)
    Attempt.objects.filter(pk=attempt.pk).update(last_activity_at=old)
    records = [
        _scalar(2, "train/loss", 2.5),
        _scalar(2, "train/loss", 9.9),  # logged twice at one step: the first stays
        _scalar(4, "train/loss", 2.0),
        _scalar(4, "train/learning_rate", 0.01),
        _scalar(5, "diverged", None),  # non-finite: the agent sends null
        _scalar(6, "x" * 100, 1.0),
    ]
    beat(a, attempt, {0: None, 1: None}, records=records)
    beat(a, attempt, {0: None, 1: None}, records=records[:3])  # a resend after a lost answer
    points = sorted(
        MetricPoint.objects.filter(job=job).values_list("name", "step", "value"), key=str
    )
    assert points == sorted(
        [
            ("train/loss", 2, 2.5),
            ("train/loss", 4, 2.0),
            ("train/learning_rate", 4, 0.01),
            ("x" * 64, 6, 1.0),
        ],
        key=str,
    )
    attempt.refresh_from_db()
    # Output of the script: activity; but not a step (the hang detector's clock stays).
    assert attempt.last_activity_at > old
    assert attempt.first_step_at is None and attempt.last_progress_at is None
    names = client_names(setup, client, job)
    assert names == sorted(["train/loss", "train/learning_rate", "x" * 64])


def client_names(setup, client, job):
    team, user, _, _ = setup
    client.force_login(user)
    response = client.get(f"/api/v1/jobs/{job.id}/metrics/names/")
    assert response.status_code == 200
    series = client.get(f"/api/v1/jobs/{job.id}/metrics/", {"name": "train/loss"}).json()
    assert series["ranks"]["0"]["step"] == [2, 4]
    return response.json()["names"]


def _lightning_save(directory, step):
    path = directory / "ckpt" / f"epoch=0-step={step}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"net.weight": torch.ones(1, 2)}, "global_step": step}, path)
    return path


@pytest.mark.django_db
def test_a_framework_save_is_recorded_with_its_format_and_the_restart_told_of_it(setup):
    job, attempt, a, root = _running(setup)
    here = attempt_dir(root, job.id, attempt.number)
    save = _lightning_save(here, 20)
    hf = here / "out" / "checkpoint-30"
    hf.mkdir(parents=True)
    elsewhere = root.parent / "other.ckpt"
    torch.save({"w": torch.ones(1)}, elsewhere)
    records = [
        {"kind": "checkpoint", "format": "lightning", "path": str(save), "step": 20, "bytes": 9},
        # Not whole (no trainer_state.json), outside the job's directory, of no known format:
        {"kind": "checkpoint", "format": "hf", "path": str(hf), "step": 30},
        {"kind": "checkpoint", "format": "torch", "path": str(elsewhere), "step": 40},
        {"kind": "checkpoint", "format": "pickle", "path": str(save), "step": 50},
    ]
    beat(a, attempt, {0: None, 1: None}, records=records)
    (checkpoint,) = Checkpoint.objects.filter(job=job)
    assert (checkpoint.format, checkpoint.step, checkpoint.path) == ("lightning", 20, str(save))
    event = Event.objects.get(job=job, kind="checkpoint.committed")
    assert event.message.startswith("Lightning .ckpt checkpoint at step 20")

    # A save without a step in its name is the attempt's latest step (its scalars' here).
    beat(a, attempt, {0: None, 1: None}, records=[_scalar(27, "loss", 1.0)])
    plain = here / "weights.pt"
    torch.save({"w": torch.ones(1)}, plain)
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[{"kind": "checkpoint", "format": "torch", "path": str(plain)}],
    )
    assert Checkpoint.objects.get(job=job, format="torch").step == 27

    beat(a, attempt, {0: 1, 1: None})  # a rank fails: the job restarts from the latest save
    run_pass(now=timezone.now() + timedelta(seconds=11))
    second = live_attempt(job)
    assert second.resumed_from.path == str(plain)
    launch = queries.launch_spec(second, a)
    assert (launch["resume_from"], launch["resume_format"]) == (str(plain), "torch")


@pytest.mark.django_db
def test_retention_leaves_a_running_frameworks_saves_and_prunes_ended_attempts(setup, settings):
    job, attempt, a, root = _running(setup)
    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 1}
    here = attempt_dir(root, job.id, attempt.number)
    saves = [_lightning_save(here, step) for step in (10, 20, 30)]
    records = [
        {"kind": "checkpoint", "format": "lightning", "path": str(p), "step": s}
        for p, s in zip(saves, (10, 20, 30), strict=True)
    ]
    beat(a, attempt, {0: None, 1: None}, records=records)
    # Running: its framework's rotation decides.
    assert prune_checkpoints(job.id) == []
    assert all(p.exists() for p in saves)
    # Ended: its rotation no longer sees them; retention keeps the newest (resumed from).
    beat(a, attempt, {0: 1, 1: None})
    assert sorted(prune_checkpoints(job.id)) == [10, 20]
    assert [p.exists() for p in saves] == [False, False, True]


@pytest.mark.django_db
def test_a_record_a_job_could_forge_never_fails_the_heartbeat(setup):
    job, attempt, a, _ = _running(setup)
    bad = [
        {"kind": "scalar", "rank": "x", "step": 1, "name": "a", "value": 1.0},
        {"kind": "scalar", "rank": 0, "step": "y", "name": "a", "value": 1.0},
        {"kind": "scalar", "rank": 0, "step": 1, "name": "a", "value": "nan-ish"},
        {"kind": "checkpoint", "format": "torch", "path": "/etc/passwd", "step": 1},
    ]
    response = beat(a, attempt, {0: None, 1: None}, records=bad)
    assert response["desired"], response
    assert not MetricPoint.objects.filter(job=job).exists()
    assert not Checkpoint.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_a_save_rewritten_in_place_updates_its_step_unless_registered(setup, make_user):
    job, attempt, a, root = _running(setup)
    path = attempt_dir(root, job.id, attempt.number) / "latest.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.ones(1)}, path)
    record = {"kind": "checkpoint", "format": "torch", "path": str(path), "bytes": 10}
    beat(a, attempt, {0: None, 1: None}, records=[{**record, "step": 10}])
    beat(a, attempt, {0: None, 1: None}, records=[{**record, "step": 20, "bytes": 12}])
    (checkpoint,) = Checkpoint.objects.filter(job=job)
    assert (checkpoint.step, checkpoint.bytes) == (20, 12)
    assert Event.objects.filter(job=job, data__rewritten=True).count() == 1
    from jobs import actions

    actions.do_register_model_version(
        name="m", checkpoint=checkpoint, actor=setup[1], now=timezone.now()
    )
    beat(a, attempt, {0: None, 1: None}, records=[{**record, "step": 30, "bytes": 14}])
    checkpoint.refresh_from_db()
    assert checkpoint.step == 20  # registered at 20: its version says so


def _export(src, out, fmt):
    return subprocess.run(
        [sys.executable, "-m", "trainer.export", str(src), str(out), "--format", fmt],
        capture_output=True,
        text=True,
    )


def test_each_framework_save_exports_the_model_weights_as_safetensors(tmp_path):
    weight = torch.arange(6.0).reshape(2, 3)
    lightning = tmp_path / "a.ckpt"
    # What Lightning writes, hyper-parameters included (read as a plain dict by name).
    from lightning.fabric.utilities.data import AttributeDict

    torch.save(
        {
            "state_dict": {"net.weight": weight, "net.tied": weight},
            "hyper_parameters": AttributeDict(lr=0.1),
            "global_step": 7,
        },
        lightning,
    )
    hf = tmp_path / "checkpoint-7"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({"net.weight": weight}, hf / "model.safetensors")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    plain = tmp_path / "model.pt"
    torch.save({"model": {"net.weight": weight}, "epoch": 3}, plain)
    for src, fmt, keys in (
        (lightning, "lightning", {"net.weight", "net.tied"}),
        (hf, "hf", {"net.weight"}),
        (plain, "torch", {"net.weight"}),
    ):
        out = tmp_path / f"{fmt}.safetensors"
        done = _export(src, out, fmt)
        assert done.returncode == 0, done.stderr
        exported = load_file(out)
        assert set(exported) == keys and torch.equal(exported["net.weight"], weight)


@pytest.mark.django_db
def test_an_export_refuses_a_save_swapped_for_a_link(setup, tmp_path):
    from jobs import actions
    from jobs.models import ModelVersion
    from jobs.tasks import export_model_version

    job, attempt, a, root = _running(setup)
    save = _lightning_save(attempt_dir(root, job.id, attempt.number), 10)
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[{"kind": "checkpoint", "format": "lightning", "path": str(save), "step": 10}],
    )
    checkpoint = Checkpoint.objects.get(job=job)
    version = actions.do_register_model_version(
        name="swap", checkpoint=checkpoint, actor=setup[1], now=timezone.now()
    )
    elsewhere = tmp_path / "someone-elses.ckpt"
    save.rename(elsewhere)
    save.symlink_to(elsewhere)
    assert export_model_version(version.id) is None
    version = ModelVersion.objects.get(pk=version.id)
    assert version.export_state == "failed"


class Payload:
    """Anything a pickle could construct: never built by the exporter."""

    def __reduce__(self):
        return (print, ("pwned",))


def test_a_save_holding_arbitrary_objects_is_refused_not_unpickled(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(1)}, "extra": Payload()}, evil)
    out = tmp_path / "out.safetensors"
    done = _export(evil, out, "torch")
    assert done.returncode == 1 and "pwned" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "never unpickled unrestricted" in last and "print" in last, last
    assert not out.exists()


@pytest.mark.django_db
def test_saves_the_attempt_ended_before_reporting_are_adopted_at_the_restart(setup):
    job, attempt, a, root = _running(setup)
    here = attempt_dir(root, job.id, attempt.number)
    saves = {step: _lightning_save(here, step) for step in (10, 20)}
    cut = here / "ckpt" / "epoch=0-step=30.ckpt"
    cut.write_bytes(b"PK\x03\x04 cut short")  # killed mid-save: never adopted
    beat(a, attempt, {0: 1, 1: None})  # fails before the agent reported any save
    run_pass(now=timezone.now() + timedelta(seconds=11))
    second = live_attempt(job)
    assert second.resumed_from.path == str(saves[20])
    assert sorted(Checkpoint.objects.filter(job=job).values_list("step", "format")) == [
        (10, "lightning"),
        (20, "lightning"),
    ]
    recovered = Event.objects.filter(job=job, kind="checkpoint.recovered")
    assert recovered.count() == 2 and "ended before the agent reported it" in recovered[0].message

    # The second attempt has the save laid out in its own directory (the agent's seed_resume):
    # when it fails too, that copy is not adopted as a save of its own.
    seeded = attempt_dir(root, job.id, second.number) / "ckpt" / "epoch=0-step=20.ckpt"
    seeded.parent.mkdir(parents=True)
    seeded.hardlink_to(saves[20])
    beat(a, second, {0: None, 1: None})
    beat(setup[2][1], second, {2: None, 3: None})
    beat(a, second, {0: 1, 1: None})
    run_pass(now=timezone.now() + timedelta(seconds=60))
    assert Checkpoint.objects.filter(job=job).count() == 2


@pytest.mark.django_db
def test_a_script_that_logged_scalars_before_failing_did_work(setup):
    """The user-error verdict (three attempts in a row failing before any work) is for commands
    that never start training; a script that reports no steps but logged scalars did work."""
    job, attempt, a, _ = _running(setup, max_restarts=5)
    b = setup[2][1]
    now = timezone.now()
    for number in range(3):
        scalar = _scalar(number + 1, "train/loss", 1.0)
        beat(a, attempt, {0: None, 1: None}, records=[scalar], now=now)
        beat(a, attempt, {0: 1, 1: None}, now=now)
        job.refresh_from_db()
        # Not "user error": it trained (and its node takes the strike for the failure).
        assert job.state == "RESTARTING", (number, job.reason)
        assert node_strikes(a, now) == number + 1
        if number == 2:
            break
        now += timedelta(seconds=10 * 2**number + 1)  # past the backoff
        beat(b, attempt, {}, now=now)  # the nodes stay alive meanwhile
        beat(a, attempt, {}, now=now)
        run_pass(now=now)
        job.refresh_from_db()
        assert job.state == "STARTING", (number, job.state, job.reason)
        attempt = live_attempt(job)
        beat(a, attempt, {0: None, 1: None}, now=now)
        beat(b, attempt, {2: None, 3: None}, now=now)
