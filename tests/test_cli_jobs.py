"""`lockstep jobs` against a live portal (pytest-django's live server): --mine and --owner, as
squeue -u; both at once is a usage error."""

import json

import pytest
from django.utils import timezone

from jobs import actions
from lockstep_cli import client
from lockstep_cli.cli import main


@pytest.mark.django_db(transaction=True)
def test_jobs_mine_and_owner(live_server, make_team, make_user, token_for, capsys):
    team = make_team("lab", quota=4)
    ann, bob = make_user("ann", team=team), make_user("bob", team=team)
    ids = {
        who.username: actions.do_submit_job(
            owner=who,
            team=team,
            now=timezone.now(),
            name=f"{who.username}-run",
            image="lockstep/trainer:latest",
            command=["python", "-m", "trainer"],
            gpus=1,
        ).id
        for who in (ann, bob)
    }
    token = token_for(ann)

    def jobs(*args) -> tuple[int, list[dict]]:
        code = main(["--url", live_server.url, "--token", token, "--json", "jobs", *args])
        out = capsys.readouterr().out
        return code, json.loads(out) if code == 0 else []

    assert {j["id"] for j in jobs()[1]} == set(ids.values())  # the team's
    assert [j["id"] for j in jobs("--mine")[1]] == [ids["ann"]]
    assert [j["id"] for j in jobs("--owner", "bob")[1]] == [ids["bob"]]
    with pytest.raises(SystemExit) as usage:
        main(["--url", live_server.url, "--token", token, "jobs", "--mine", "--owner", "bob"])
    assert usage.value.code == client.EXIT_USAGE
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["jobs", "--owner", " "], "give a username"),
        (["events", "1", "--tail", "-1"], "0 or more"),
        (["events", "1", "--tail", "x"], "not a number"),
    ],
)
def test_bad_arguments_exit_2_before_asking_the_portal(args, message, capsys):
    # No portal at this URL: a usage error must come first.
    with pytest.raises(SystemExit) as usage:
        main(["--url", "http://127.0.0.1:9", "--token", "lst_x", *args])
    assert usage.value.code == client.EXIT_USAGE
    assert message in capsys.readouterr().err
