"""What the console's tests (tests/test_console*.py) share: a client logged in as a user, the
console's pages, the `shared` cluster every page is shown on, and a table's row ids.

`shared` is named for pytest with `name=`: a test file imports `shared_fixture` and its tests ask
for `shared` as usual."""

import pytest
from django.test import Client

from jobs.scheduling.loop import run_pass
from tests.heartbeats import submit

CONSOLE = ("/console/queue/", "/console/nodes/", "/console/reports/", "/console/events/")


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(name="shared")
def shared_fixture(make_team, make_user, make_nodes):
    """Two 2-GPU nodes; team lab (quota 2, may borrow 6) runs a 1-GPU and a 2-GPU job and
    waits with a 4-GPU one, which holds a reservation on both nodes; team nlp runs a 1-GPU job.
    lena leads lab, ann is a member of lab, bob leads nlp, sam is in no team, root is staff."""
    nodes = make_nodes(2, 2)
    lab = make_team("lab", quota=2, borrow_limit=6)
    nlp = make_team("nlp", quota=2)
    users = {
        "root": make_user("root", staff=True),
        "lena": make_user("lena", team=lab, role="lead"),
        "ann": make_user("ann", team=lab),
        "bob": make_user("bob", team=nlp, role="lead"),
        "sam": make_user("sam"),
    }
    small = submit(lab, users["ann"], gpus=1)
    pair = submit(lab, users["ann"], gpus=2)
    run_pass()
    other = submit(nlp, users["bob"], gpus=1)
    big = submit(lab, users["ann"], gpus=4)
    run_pass()
    jobs = {"small": small, "pair": pair, "other": other, "big": big}
    for job in jobs.values():
        job.refresh_from_db()
    return {"nodes": nodes, "lab": lab, "nlp": nlp, "users": users, "jobs": jobs}


def _rows(html: str, attribute: str) -> set[str]:
    import re

    return set(re.findall(rf'<tr {attribute}="([^"]+)"', html))
