"""Every state change (`do_*` in an actions module) runs in a transaction: it is decorated
with `transaction.atomic`, opens one, or is one of the few below that run inside their
caller's. SQLite ignores row locks outside a transaction, so a lost decorator passes every
SQLite test and fails only on PostgreSQL: inserting helpers above `do_mark_node_lost` once
moved its `@transaction.atomic` onto the helper, and lost nodes were never marked there."""

import ast
import importlib
import inspect
import pkgutil

import pytest

import jobs.actions
import teams.actions

# Every module of the jobs.actions package (one per concept), and the teams' actions.
ACTION_MODULES = [
    importlib.import_module(f"jobs.actions.{info.name}")
    for info in pkgutil.iter_modules(jobs.actions.__path__)
] + [teams.actions]

# Not transactions of their own, and why.
INSIDE_THE_CALLERS = {
    "do_start_attempt": "one gang of do_start_attempts, inside the applier's transaction",
    "do_start_attempts": "the applier's batch; it asserts it runs in a transaction",
    "do_end_hung_attempt": "its one write is do_end_attempt, which is atomic",
}


def _state_changes():
    for module in ACTION_MODULES:
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("do_"):
                yield pytest.param(node, id=f"{module.__name__}.{node.name}")


@pytest.mark.parametrize("function", list(_state_changes()))
def test_every_state_change_runs_in_a_transaction(function):
    decorated = any(
        ast.unparse(d).startswith("transaction.atomic") for d in function.decorator_list
    )
    opens_one = "transaction.atomic(" in ast.unparse(function)
    assert decorated or opens_one or function.name in INSIDE_THE_CALLERS, (
        f"{function.name} changes state outside a transaction"
    )


def test_no_helper_carries_a_transaction_decorator_meant_for_a_state_change():
    """The slip itself: `@transaction.atomic` left on a pure helper above the function it
    was meant for."""
    for module in ACTION_MODULES:
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                uses_db = any(
                    word in ast.unparse(node)
                    for word in (".objects", "select_for_update", ".save(", "_event(")
                )
                assert uses_db or not any(d.startswith("transaction.") for d in decorators), (
                    f"{module.__name__}.{node.name} is atomic but touches no database"
                )


def test_the_walk_covers_every_state_change_of_the_package():
    """A module added to jobs/actions/ is walked without being listed here: every do_* the
    package hands on is found in one of the walked modules."""
    walked = {node.name for param in _state_changes() for node in param.values}
    assert set(name for name in jobs.actions.__all__ if name.startswith("do_")) <= walked
    assert len(ACTION_MODULES) >= 10
