"""The scheduler pass and Python's garbage collector (jobs/scheduling/loop.py): no collection
runs during a pass (at the target's size the automatic ones took 0.05-0.13 s of it), the
collector is left as the pass found it, and the leader collects between passes instead."""

import gc

import pytest

from jobs.scheduling import loop
from tests.heartbeats import submit


@pytest.fixture
def collections():
    """The generations of the collections that start while the test runs."""
    seen: list[int] = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(on_gc)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_gc)


@pytest.mark.django_db
def test_no_collection_runs_during_a_pass(collections, make_team, make_user, make_nodes):
    team = make_team("a", quota=16)
    user = make_user("au", team=team)
    make_nodes(2, 8)
    for k in range(40):
        submit(team, user, gpus=4, name=f"j{k}")
    gc.collect()
    collections.clear()
    report, _ = loop.run_pass()
    assert report.applied == 4 and collections == []  # four placed, no collection
    assert gc.isenabled()  # left as found
    # A caller that had paused the collector itself finds it paused still.
    gc.disable()
    try:
        loop.run_pass()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_leader_collects_between_passes_and_freezes_what_its_first_left(collections):
    assert gc.get_freeze_count() == 0
    try:
        loop._collect_between_passes()
        assert collections and collections[0] == 2  # a full collection
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the platform's code and settings: never scanned again
        later = [{"alive": k} for k in range(5000)]  # objects of a later pass, still alive
        loop._collect_between_passes()
        # Frozen once per process, not every pass: the later objects stay collectable (the
        # count may fall, as frozen objects are freed by their references).
        assert gc.get_freeze_count() <= frozen and later
    finally:
        gc.unfreeze()
