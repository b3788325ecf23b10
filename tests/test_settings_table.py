"""Lockstep's settings come from one table (jobs/settings_table.py): the portal's LOCKSTEP dict,
the accessor's defaults and the documentation all follow it."""

from pathlib import Path

import pytest
from django.conf import settings

from jobs.conf import lockstep_setting
from jobs.settings_table import DEFAULTS, TABLE, env_name, markdown, read_settings

ROOT = Path(__file__).resolve().parent.parent


def test_a_variable_is_read_as_its_defaults_type_and_the_rest_keep_their_defaults(tmp_path):
    secret_file = tmp_path / "token"
    secret_file.write_text("from-a-file\n")
    environ = {
        "LOCKSTEP_HEARTBEAT_S": "2.5",
        "LOCKSTEP_STRIKES_TO_CORDON": "5",
        "LOCKSTEP_CHECKPOINT_ROOT": "/shared/ckpt",
        "LOCKSTEP_WHATIF_INLINE_MAX_JOBS": "7",  # settings only: not read from the environment
        "LOCKSTEP_IMAGE_REGISTRIES": " registry.example.org, localhost ,",
        "LOCKSTEP_ALLOW_PROCESS_NODES": "false",
    }

    def secret(name):
        return secret_file.read_text().strip() if name == "LOCKSTEP_AGENT_TOKEN" else None

    values = read_settings(environ, var_dir=tmp_path, secret=secret)
    assert values["HEARTBEAT_S"] == 2.5 and values["STRIKES_TO_CORDON"] == 5
    assert isinstance(values["STRIKES_TO_CORDON"], int)
    assert values["CHECKPOINT_ROOT"] == "/shared/ckpt"
    assert values["MODEL_ROOT"] == str(tmp_path / "models")
    assert values["AGENT_TOKEN"] == "from-a-file" and values["METRICS_TOKEN"] is None
    assert values["WHATIF_INLINE_MAX_JOBS"] == DEFAULTS["WHATIF_INLINE_MAX_JOBS"] == 300
    assert values["IMAGE_REGISTRIES"] == ["registry.example.org", "localhost"]  # a list, trimmed
    assert values["ALLOWED_DATASET_SCHEMES"] == ["synthetic", "file"]
    assert values["ALLOW_PROCESS_NODES"] is False  # "false" is not truthy here
    assert values["STOP_GRACE_S"] == DEFAULTS["STOP_GRACE_S"] == 60.0
    assert set(values) == {s.name for s in TABLE}


def test_the_accessor_falls_back_to_the_tables_default(settings):
    settings.LOCKSTEP = {}
    assert lockstep_setting("KEEP_CHECKPOINTS") == DEFAULTS["KEEP_CHECKPOINTS"] == 3


def test_the_portals_settings_hold_every_setting_of_the_table():
    assert set(settings.LOCKSTEP) >= {s.name for s in TABLE}


def test_the_settings_page_is_made_from_the_table():
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page == markdown(), "run: python -m jobs.settings_table > docs/settings.md"
    assert all(env_name(s) in page for s in TABLE if s.env)


def test_a_value_of_the_wrong_type_is_refused_by_its_variables_name(tmp_path):
    for variable, value in (
        ("LOCKSTEP_ESTIMATE_EVERY_S", "abc"),
        ("LOCKSTEP_STRIKES_TO_CORDON", "2.5"),
    ):
        with pytest.raises(ValueError, match=f"{variable}='{value}' is not a"):
            read_settings({variable: value}, var_dir=tmp_path, secret=lambda name: None)
