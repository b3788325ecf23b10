"""The victim search's shortcuts (jobs/scheduling/victims.py) decide nothing of their own:
`_Fits` says a placement exists exactly when placement.place finds one, and `Chosen` counts
each team's GPUs as summing the list would."""

import random

from jobs.scheduling.placement import place, release
from jobs.scheduling.victims import Chosen, _Fits, team_gpus
from tests.builders import job, node, running


def test_fits_agrees_with_place_after_every_release():
    rng = random.Random(7)
    for case in range(300):
        sizes = [rng.choice([4, 8, 8, 8, 0]) for _ in range(rng.randint(1, 12))]
        nodes = [
            node(f"n{case}-{i}", gpus, busy=rng.randint(0, gpus), rack=f"r{i % 3}")
            for i, gpus in enumerate(sizes)
        ]
        free = {n.id: sorted(n.free) for n in nodes}
        # Victims hold GPUs that are busy; some of them on nodes outside the search.
        victims = []
        for n in nodes:
            busy = sorted(set(range(n.total)) - n.free)
            while busy:
                take, busy = busy[: rng.randint(1, 4)], busy[rng.randint(1, 4) :]
                victims.append(running(len(victims) + 1, n, take, team_id=rng.randint(1, 3)))
        searched = rng.sample(nodes, rng.randint(1, len(nodes)))
        claimant = job(1, rng.choice([1, 2, 4, 8, 12, 16, 24, 32]), team_id=9)
        trial = {k: list(v) for k, v in free.items()}
        fits = _Fits(claimant.gpus, trial, searched)
        assert fits.ok == (place(claimant, trial, searched) is not None), case
        for victim in rng.sample(victims, len(victims)):
            release(trial, victim)
            on = tuple(dict.fromkeys(node_id for node_id, _ in victim.slots))
            assert fits.released(on) == (place(claimant, trial, searched) is not None), case


def test_chosen_counts_each_teams_gpus_through_appends_and_truncation():
    n = node("c", 8)
    victims = [running(i + 1, n, [i], team_id=1 + i % 3) for i in range(8)]
    chosen = Chosen()
    for victim in victims:
        chosen.append(victim)
        for team in (1, 2, 3, 4):
            assert team_gpus(chosen, team) == team_gpus(list(chosen), team)
    chosen.truncate(3)
    assert list(chosen) == victims[:3]
    assert [team_gpus(chosen, t) for t in (1, 2, 3)] == [1, 1, 1]
    assert team_gpus(Chosen(victims), 1) == sum(v.gpus for v in victims if v.team_id == 1)
