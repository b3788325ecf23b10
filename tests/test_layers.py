"""The house's layers, checked from the code's own imports (every import, at the top of a
module or inside a function, so none can hide a circle):

    web (portal/, the REST and agent endpoints, serializers, consumers, admin)
      -> domain (jobs/ and teams/: models, actions, queries, reports, the scheduler's process)
        -> pure scheduling (snapshot types, vocabulary, policy, simulator: no Django)
          -> shared tables (settings, event kinds: no Django, import nothing of ours)

- no import circle anywhere in product code;
- the domain imports nothing of the web; the pure scheduling modules import no Django and
  nothing of the domain;
- trainer/ and nodeagent/ import nothing of the portal, the domain or the CLI;
- the domain imports no torch, not even through a trainer module;
- the CLI and REST client import no Django and nothing of the portal or the domain.

docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jobs", "teams", "portal", "nodeagent", "trainer", "lockstep_cli")

# The web layer inside the apps: modules that speak HTTP or websockets, or are Django admin.
WEB_MODULES = {
    "jobs.admin",
    "jobs.agent_api",
    "jobs.api",
    "jobs.consumers",
    "jobs.plan_api",
    "jobs.preemption_api",
    "jobs.serializers",
    "jobs.whatif_api",
    "teams.admin",
    "teams.api",
    "teams.tokens_api",
}
# Plain tables every layer may read, the pure scheduler included.
SHARED_MODULES = {"jobs.event_kinds", "jobs.settings_table"}
# jobs/scheduling/ modules that run the pure policy inside the Django process: they read the
# database, take the leader lock or apply a plan. Every other module there is pure.
SCHEDULING_PROCESS = {
    "jobs.scheduling.apply",
    "jobs.scheduling.detect",
    "jobs.scheduling.leader",
    "jobs.scheduling.loop",
    "jobs.scheduling.reader",
    "jobs.scheduling.wake",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[_module_name(path)] = path
    return found


def _resolve(name: str) -> str | None:
    """The product module an imported name refers to (a name inside a module counts as the
    module), or None for a third-party one."""
    known = modules()
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(product modules, other top-level packages) that `module` imports anywhere in it."""
    path = modules()[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                inside.add(target)
            elif target is None:
                outside.add(name.split(".")[0])
    return frozenset(inside), frozenset(outside)


@cache
def reachable(module: str) -> frozenset[str]:
    seen, todo = {module}, [module]
    while todo:
        for target in imports(todo.pop())[0]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return frozenset(seen)


def layer(module: str) -> str:
    top = module.split(".")[0]
    if top in ("trainer", "nodeagent"):
        return top
    if top == "lockstep_cli":
        return "cli"
    if module in SHARED_MODULES:
        return "shared"
    if top == "portal" or module in WEB_MODULES or ".management." in module:
        return "web"
    if module.startswith("jobs.scheduling.") and module not in SCHEDULING_PROCESS:
        return "pure"
    return "domain"


def _all(kind: str) -> list[str]:
    return sorted(m for m in modules() if layer(m) == kind)


def test_the_layers_are_all_populated():
    """The rules below would pass vacuously on a renamed folder."""
    for kind in ("web", "domain", "pure", "trainer", "nodeagent", "cli"):
        assert len(_all(kind)) >= 3, kind
    assert set(_all("shared")) == SHARED_MODULES
    assert "jobs.scheduling.policy" in _all("pure") and "jobs.actions.claim" in _all("domain")


def test_no_import_circle_in_product_code():
    """Tarjan's strongly connected components over every import, function-level included."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(imports(module)[0]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(modules()):
        if module not in index:
            visit(module)
    assert circles == []


@pytest.mark.parametrize("module", _all("shared"))
def test_the_shared_tables_import_nothing_of_ours_and_no_django(module):
    assert imports(module)[0] == frozenset() and "django" not in imports(module)[1]


@pytest.mark.parametrize("module", _all("domain") + _all("pure"))
def test_the_domain_and_the_scheduler_import_nothing_of_the_web(module):
    above = sorted(t for t in imports(module)[0] if layer(t) in ("web", "cli"))
    assert above == [], f"{module} imports the web layer: {above}"


@pytest.mark.parametrize("module", _all("pure"))
def test_the_pure_scheduling_modules_import_no_django_and_no_domain(module):
    reached = reachable(module)
    impure = sorted(m for m in reached if layer(m) not in ("pure", "shared"))
    assert impure == [], f"{module} reaches {impure}"
    django = sorted(m for m in reached if "django" in imports(m)[1])
    assert django == [], f"{module} reaches Django through {django}"


@pytest.mark.parametrize("module", _all("trainer") + _all("nodeagent"))
def test_trainer_and_nodeagent_import_nothing_of_the_platform(module):
    platform = sorted(t for t in imports(module)[0] if layer(t) in ("web", "domain", "pure", "cli"))
    assert platform == [], f"{module} imports {platform}"
    assert "django" not in imports(module)[1]


@pytest.mark.parametrize("module", _all("domain") + _all("pure"))
def test_the_domain_imports_no_torch(module):
    """Not even through a trainer module: the scheduler and the portal must not load torch
    (seconds and hundreds of MB) to read a checkpoint marker."""
    torch_users = sorted(m for m in reachable(module) if "torch" in imports(m)[1])
    assert torch_users == [], f"{module} reaches torch through {torch_users}"


@pytest.mark.parametrize("module", _all("cli"))
def test_the_cli_imports_no_django_and_nothing_of_the_portal(module):
    reached = reachable(module)
    platform = sorted(m for m in reached if layer(m) in ("web", "domain"))
    assert platform == [], f"{module} reaches {platform}"
    assert not [m for m in reached if "django" in imports(m)[1]]


def test_the_checker_sees_function_level_imports():
    """The rules rest on seeing imports hidden inside functions: trainer.export imports torch
    only inside export(), and the checker counts it."""
    tree = ast.parse((ROOT / "trainer" / "export.py").read_text(encoding="utf-8"))
    top_level = {
        a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names
    }
    assert "torch" not in top_level
    assert "torch" in imports("trainer.export")[1]


def test_the_portal_scheduler_and_queue_worker_load_no_torch():
    """The same rule at run time, where a third-party import could still bring torch in: the
    modules the portal, the scheduler and the queue worker start from."""
    import subprocess
    import sys

    code = (
        "import os, sys; os.environ['DJANGO_SETTINGS_MODULE'] = 'portal.settings'; "
        "import django; django.setup(); "
        "import portal.urls, portal.asgi, jobs.scheduling.loop, jobs.tasks, jobs.worker; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
