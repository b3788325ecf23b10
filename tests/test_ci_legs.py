"""CI's two legs: what runs only in `make test` (tests/conftest.py ONE_LEG) is named by file,
and a rename must not silently move a file into both legs or out of the list's sight."""

from pathlib import Path

import pytest

from tests.conftest import ONE_LEG

TESTS = Path(__file__).resolve().parent


def test_every_one_leg_file_exists_and_says_why():
    missing = sorted(name for name in ONE_LEG if not (TESTS / name).is_file())
    assert missing == []
    assert all(len(why) > 10 for why in ONE_LEG.values())


def test_the_marker_reaches_the_listed_files(request):
    """This file is not listed: it runs in both legs, so it carries no one_leg mark."""
    assert Path(__file__).name not in ONE_LEG
    assert request.node.get_closest_marker("one_leg") is None


@pytest.mark.parametrize("name", ["test_policy.py", "test_trainer.py"])
def test_the_pure_and_torch_suites_are_one_leg(name):
    assert name in ONE_LEG
