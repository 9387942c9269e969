"""The package's type information as users' type checkers read it."""

import ast
from pathlib import Path

import django_dbqueue

INIT = Path(django_dbqueue.__file__)


def type_checking_exports() -> dict[str, str]:
    """``{name: module}`` of the ``if TYPE_CHECKING:`` re-exports in django_dbqueue/__init__.py."""
    tree = ast.parse(INIT.read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    found = {}
    for statement in block.body:
        assert isinstance(statement, ast.ImportFrom) and statement.level == 1, ast.unparse(statement)
        for alias in statement.names:
            # "X as X" is what makes a type checker treat the name as re-exported.
            assert alias.asname == alias.name, f"{alias.name} must be imported as {alias.name}"
            found[alias.name] = statement.module
    return found


def test_type_checkers_see_every_public_name_where_it_is_imported_at_run_time():
    assert type_checking_exports() == django_dbqueue._EXPORTS


def test_the_package_is_marked_typed():
    assert (INIT.parent / "py.typed").is_file()
