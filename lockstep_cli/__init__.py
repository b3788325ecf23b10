"""The `lockstep` command and its REST client, apart from the portal: the client talks to a portal
over HTTP only, so it installs and runs without Django or a database.

Modules: cli (the entry point, `plan`, `simulate`, and the hand-over of `up` and `scheduler`),
commands (the commands that call the REST API), client (portal URL, token, HTTP answers as exit
codes), output (tables, times, sizes).

The rule (tests/test_cli_layers.py holds it): nothing here imports Django, portal/, teams/ or the
Django parts of jobs/, not even inside a function. A command that needs the Django side becomes
that side's own process (`os.execv` of `python -m portal.up`, `python -m django run_scheduler`),
with the same arguments, output and exit code. What may be imported, lazily so that `lockstep
jobs` stays quick: nodeagent (`agent`), trainer.planner (`plan`, no torch) and the pure
jobs.scheduling.simulate and .report (`simulate`).
"""
