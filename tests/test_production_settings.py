"""LOCKSTEP_ENV=production: `manage.py check --deploy` passes with a secret key from a file,
and the portal refuses to start without a secret key or allowed hosts."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET_VARS = ("LOCKSTEP_SECRET_KEY", "DJANGO_SECRET_KEY")


def manage(args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_VARS)}
    base.pop("LOCKSTEP_DEBUG", None)
    # Set by the browser tests' modules at collection (Playwright's sync API in pytest); a
    # deployment never has it, and check --deploy rightly refuses it (async.E001).
    base.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**base, "LOCKSTEP_VAR_DIR": str(tmp_path / "var"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_deploy_check_passes_in_production_with_a_secret_key_file(tmp_path):
    key = tmp_path / "secret_key"
    key.write_text(secrets.token_urlsafe(50) + "\n")
    result = manage(
        ["check", "--deploy", "--fail-level", "WARNING"],
        {
            "LOCKSTEP_ENV": "production",
            "LOCKSTEP_SECRET_KEY_FILE": str(key),
            "LOCKSTEP_ALLOWED_HOSTS": "lockstep.example.org",
        },
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout
    # The key came from the file: nothing was generated under var/.
    assert not (tmp_path / "var" / "secret_key").exists()


def test_production_refuses_to_start_without_a_secret_key(tmp_path):
    result = manage(
        ["check"],
        {"LOCKSTEP_ENV": "production", "LOCKSTEP_ALLOWED_HOSTS": "lockstep.example.org"},
        tmp_path,
    )
    assert result.returncode != 0
    assert "LOCKSTEP_ENV=production needs a secret key" in result.stderr
    assert not (tmp_path / "var" / "secret_key").exists()


def test_production_refuses_to_start_without_allowed_hosts(tmp_path):
    result = manage(
        ["check"],
        {"LOCKSTEP_ENV": "production", "LOCKSTEP_SECRET_KEY": secrets.token_urlsafe(50)},
        tmp_path,
    )
    assert result.returncode != 0
    assert "needs LOCKSTEP_ALLOWED_HOSTS" in result.stderr


def test_the_embedded_setup_still_runs_without_any_secret(tmp_path):
    result = manage(["check"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "var" / "secret_key").exists()


def test_a_postgresql_connection_pool_is_used_unless_turned_off(tmp_path):
    """LOCKSTEP_DB_POOL_MAX (default 4): the portal's processes borrow connections from
    psycopg's pool (a dependency: `psycopg[pool]`), against this machine's PostgreSQL; 0
    turns it off."""
    script = (
        "from django.db import connection\n"
        "with connection.cursor() as c:\n"
        "    c.execute('select 41 + 1')\n"
        "    print(c.fetchone()[0], type(connection.pool).__name__, connection.pool.max_size)\n"
    )
    env = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test"}
    pooled = manage(["shell", "-c", script], env, tmp_path)
    assert pooled.returncode == 0, pooled.stderr[-2000:]
    # The last line: Django 5.2's shell first says what it imported by itself.
    assert pooled.stdout.strip().splitlines()[-1].split() == ["42", "ConnectionPool", "4"]
    wider = manage(["shell", "-c", script], {**env, "LOCKSTEP_DB_POOL_MAX": "8"}, tmp_path)
    assert wider.stdout.strip().splitlines()[-1].split() == ["42", "ConnectionPool", "8"]
    plain = manage(
        ["shell", "-c", "from django.db import connection; print(connection.pool)"],
        {**env, "LOCKSTEP_DB_POOL_MAX": "0"},
        tmp_path,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.strip().splitlines()[-1] == "None"
