"""The `lockstep` command imports no Django: lockstep_cli names nothing of Django, portal/,
teams/ or the Django parts of jobs/, not even inside a function, and what it does name loads
none of them (nor torch); `up` is handed over to portal.up's own process, unchanged."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lockstep_cli"
FORBIDDEN = ("django", "rest_framework", "channels", "portal", "teams", "jobs")
# The pure scheduling modules `lockstep simulate` runs; the rest of jobs/ is the Django domain.
PURE_JOBS = (
    "jobs.scheduling.simulate",
    "jobs.scheduling.trace",
    "jobs.scheduling.generate",
    "jobs.scheduling.report",
)
# Modules of jobs/ outside jobs/scheduling/ that name no Django (they say so) and that the
# pure modules load: the settings table's defaults (start estimates, via promises).
PURE_DOMAIN = ("jobs.settings_table",)


def _imported_modules() -> set[str]:
    """Every module an import statement in the package names, at any depth of the code."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_cli_package_names_no_django_module():
    named = _imported_modules()
    bad = sorted(n for n in named if _top(n) in FORBIDDEN and n not in PURE_JOBS)
    assert bad == [], f"lockstep_cli imports {bad}: hand the command over to a process instead"


def test_importing_the_cli_and_what_it_names_loads_no_django_and_no_torch():
    first_party = sorted(
        n
        for n in _imported_modules()
        if _top(n) in ("lockstep_cli", "nodeagent", "trainer", "jobs")
    )
    code = (
        "import importlib, json, sys\n"
        f"for name in {json.dumps(['lockstep_cli.cli', *first_party])}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    )
    tops = {_top(m) for m in loaded}
    assert not tops & {"django", "rest_framework", "channels", "portal", "teams", "torch"}
    # jobs/ and jobs/scheduling/ are empty packages; any other jobs module is the domain's,
    # but for the settings table (no Django: its defaults are the simulator's estimates').
    jobs_modules = [m for m in loaded if _top(m) == "jobs" and m not in ("jobs", "jobs.scheduling")]
    assert all(m.startswith("jobs.scheduling.") or m in PURE_DOMAIN for m in jobs_modules), (
        jobs_modules
    )


def test_up_is_handed_over_with_its_arguments_and_exit_code():
    bad = subprocess.run(
        [sys.executable, "-m", "lockstep_cli.cli", "up", "--bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "lockstep up: error: unrecognized arguments: --bogus" in bad.stderr
