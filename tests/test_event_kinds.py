"""Event kinds come from one list (jobs.event_kinds.EventKind): code that writes an Event names
a member, and an unknown kind fails where it is written."""

import ast
from pathlib import Path

import pytest
from django.utils import timezone

from jobs.actions.base import record_event
from jobs.event_kinds import EventKind
from jobs.models import Event

ROOT = Path(__file__).resolve().parent.parent
WRITERS = ("jobs", "teams", "portal")


def _event_kind_literals():
    """String literals given as an Event's kind: `kind="..."` in an Event(...) or
    Event.objects.create(...) call, or the first argument of record_event(...)."""
    for package in WRITERS:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                candidates = []
                if name in ("Event", "Event.objects.create"):
                    candidates = [k.value for k in node.keywords if k.arg == "kind"]
                elif name == "record_event" and node.args:
                    candidates = [node.args[0]]
                for value in candidates:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        yield f"{path.relative_to(ROOT)}:{node.lineno}: {value.value!r}"


def test_no_event_is_written_with_a_bare_string_kind():
    assert list(_event_kind_literals()) == []


def test_the_scan_finds_the_writers():
    """It would pass vacuously if it never met a writer: count the EventKind ones it meets."""
    source = (ROOT / "jobs" / "actions" / "attempts.py").read_text(encoding="utf-8")
    assert source.count("record_event(") >= 3 and "EventKind." in source


@pytest.mark.django_db
def test_an_unknown_kind_is_refused_where_it_is_written():
    with pytest.raises(ValueError):
        record_event("job.sumbitted", "a typo")
    assert not Event.objects.exists()
    event = record_event(EventKind.JOB_SUBMITTED, "known\x00kind")
    assert (event.kind, event.message) == ("job.submitted", "known\ufffdkind")
    assert timezone.now() >= event.created_at
