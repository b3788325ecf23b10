"""The models and their migrations agree: a model change without its migration fails here,
not on a fresh database at `make up`."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_every_model_change_has_its_migration():
    try:
        call_command("makemigrations", "--check", "--dry-run", verbosity=0)
    except SystemExit as exc:  # makemigrations --check exits 1 when one is missing
        pytest.fail(f"a model change has no migration (makemigrations --check exited {exc.code})")
