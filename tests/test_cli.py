"""The `lockstep` CLI's portal commands without a portal: where the URL and token come from,
and the exit codes for no token, an unreachable portal and a bad spec file."""

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep_cli import client, commands

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("LOCKSTEP_URL", "LOCKSTEP_PORTAL", "LOCKSTEP_TOKEN", "LOCKSTEP_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def _config(tmp_path, text: str) -> Path:
    path = tmp_path / "xdg" / "lockstep" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_flags_beat_the_environment_which_beats_the_config_file(clean_env, monkeypatch):
    _config(clean_env, 'url = "http://from-file:1"\ntoken = "lst_file"\n')
    none = SimpleNamespace()
    assert client.resolve(none) == ("http://from-file:1", "lst_file")
    monkeypatch.setenv("LOCKSTEP_URL", "http://from-env:2/")
    monkeypatch.setenv("LOCKSTEP_TOKEN", "lst_env")
    assert client.resolve(none) == ("http://from-env:2", "lst_env")
    flags = SimpleNamespace(url="http://flag:3", token="lst_flag")
    assert client.resolve(flags) == ("http://flag:3", "lst_flag")


def test_without_anything_the_url_is_the_local_portal_and_there_is_no_token(clean_env):
    assert client.resolve(SimpleNamespace()) == (client.DEFAULT_URL, None)


def test_lockstep_config_names_the_file_and_a_missing_one_is_an_error(clean_env, monkeypatch):
    other = clean_env / "other.toml"
    other.write_text('url = "http://other:4"\n')
    monkeypatch.setenv("LOCKSTEP_CONFIG", str(other))
    assert client.resolve(SimpleNamespace())[0] == "http://other:4"
    monkeypatch.setenv("LOCKSTEP_CONFIG", str(clean_env / "missing.toml"))
    with pytest.raises(client.CliError) as err:
        client.resolve(SimpleNamespace())
    assert err.value.code == client.EXIT_USAGE


def _lockstep(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep_cli.cli", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exit_codes_without_a_portal(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path), "LOCKSTEP_TOKEN": "", "LOCKSTEP_URL": ""}
    no_token = _lockstep("jobs", env=env)
    assert no_token.returncode == client.EXIT_AUTH and "no API token" in no_token.stderr
    url = f"http://127.0.0.1:{_closed_port()}"
    down = _lockstep("jobs", "--json", env={**env, "LOCKSTEP_TOKEN": "x", "LOCKSTEP_URL": url})
    assert down.returncode == client.EXIT_UNREACHABLE and "cannot reach" in down.stderr
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: run1\nteam: t\ngpus: 1\nflavour: spicy\n")
    bad = _lockstep("submit", "-f", str(spec), env={**env, "LOCKSTEP_TOKEN": "x"})
    assert bad.returncode == client.EXIT_USAGE and "unknown field(s) flavour" in bad.stderr


def test_a_spec_file_is_overridden_by_flags(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: run1\nteam: nlp\ngpus: 2\ncommand: [python, -m, trainer]\nenv: {A: '1'}\n"
    )
    args = SimpleNamespace(file=str(spec), gpus=4, env=["B=2"], command=[], name=None)
    body = commands.job_body(args)
    assert body == {
        "name": "run1",
        "team": "nlp",
        "gpus": 4,
        "command": ["python", "-m", "trainer"],
        "env": {"A": "1", "B": "2"},
        "image": "lockstep/trainer:latest",
        "dataset": "synthetic://addition",
    }


@pytest.mark.parametrize("jobs", ["3000", "5"])  # 130 KB, written at once; 300 B, at exit
def test_a_reader_that_went_away_ends_the_command_quietly_as_sigpipe_would(jobs):
    """`lockstep ... | head`: the reader is gone before the command writes."""
    from lockstep_cli.cli import EXIT_BROKEN_PIPE

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lockstep_cli.cli", "trace", "--jobs", jobs, "--seed", "0"],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == EXIT_BROKEN_PIPE == 141
    assert done.stderr == ""  # no traceback


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    """A socket's or a child's broken pipe is an error, with its traceback: only a reader of
    stdout going away ends a command quietly."""
    from lockstep_cli import cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["jobs"])
