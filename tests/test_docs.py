"""The documentation as a newcomer uses it: code blocks that run as pasted, and every page reachable.

A Python block preceded by the line ``<!-- runnable -->`` is one a user
pastes (docs/development.md): each runs here on its own, in a fresh
namespace, as pasted, imports included. Before it runs, every name it uses,
inside its functions too, must be defined by the block or be a builtin, so
a handler that calls an undefined function fails here and not in the
reader's worker. A block that defines ``DBQUEUE`` must be a valid setting;
a block that defines ``test_*`` functions has them called with their
pytest fixtures. A block that starts with ``# settings.py`` runs after what
``startproject`` writes there (``BASE_DIR``, ``DATABASES``); a ``TASKS``
entry for the queue's backend must pass the backend's checks.
"""

from __future__ import annotations

import ast
import builtins
import gc
import inspect
import os
import re
import subprocess
import symtable
import sys
import textwrap
from dataclasses import dataclass

import pytest
from django.apps import apps
from django.db import connection

from django_dbqueue import handlers
from django_dbqueue.conf import find_problems, task_backend_problems
from django_dbqueue.models import ArchivedMessage
from django_dbqueue.schedules import registry
from django_dbqueue.validation import QUEUE_NAME_MAX_LENGTH
from tests.support.processes import ROOT
from tests.test_example_project import example_database_url

MARKER = "<!-- runnable -->"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the fence's first line, 1-based
    code: str
    runnable: bool

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(page: str) -> list[Block]:
    """The page's fenced Python blocks, dedented (a block may sit in a list item), marked or not."""
    lines = (DOCS / page).read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        if opening["lang"] == "python":
            before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            code = textwrap.dedent("\n".join(lines[index + 1 : end]))
            blocks.append(Block(page, index + 1, code + "\n", before == MARKER))
        index = end + 1
    return blocks


def pages() -> list[str]:
    return sorted(path.name for path in DOCS.glob("*.md"))


def in_the_example_shop(block: Block) -> bool:
    """A block that imports the example shop's models runs in the example project, not here."""
    return bool(re.search(r"^\s*from shop[.\s]", block.code, re.M))


RUNNABLE = [block for page in pages() for block in python_blocks(page) if block.runnable]
HERE = [block for block in RUNNABLE if not in_the_example_shop(block)]
SHOP = [block for block in RUNNABLE if in_the_example_shop(block)]


def startproject_settings() -> dict:
    """What ``django-admin startproject`` puts in settings.py before a block pasted there."""
    return {
        "BASE_DIR": ROOT,
        "INSTALLED_APPS": ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes"],
        "DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ROOT / "db.sqlite3"}},
    }


def is_settings(block: Block) -> bool:
    return block.code.startswith("# settings.py")


def undefined_names(block: Block) -> set[str]:
    """Names the block's code reads, at any depth, that neither the block nor Python defines."""
    top = symtable.symtable(block.code, str(block), "exec")
    defined = {symbol.get_name() for symbol in top.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    known = defined | set(dir(builtins)) | {"__name__", "__file__"}
    if is_settings(block):
        known |= set(startproject_settings())
    missing = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and symbol.is_global() and symbol.get_name() not in known:
                missing.add(symbol.get_name())
    return missing


@pytest.fixture
def isolated_declarations():
    """Handlers, schedules and signal receivers a block declares go away after it."""
    saved_handlers = handlers.registered()
    saved_schedules = registry.snapshot()
    yield
    for key in set(handlers.registered()) - set(saved_handlers):
        handlers.unregister(*key)
    handlers._registry.update(saved_handlers)
    registry.restore(saved_schedules)
    gc.collect()  # receivers connected weakly go with the block's namespace


def ellipsis_items(block: Block) -> list[int]:
    """Lines where ``...`` stands as an item of a list, tuple or set: pasted, it is an item (write ``# ...``)."""
    tree = ast.parse(block.code)
    return [
        item.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.List | ast.Tuple | ast.Set)
        for item in node.elts
        if isinstance(item, ast.Constant) and item.value is Ellipsis
    ]


def run_block(block: Block, request: pytest.FixtureRequest) -> dict:
    assert not (missing := undefined_names(block)), f"{block} uses names it never defines or imports: {sorted(missing)}"
    assert not (lines := ellipsis_items(block)), f"{block}: a literal ... as an item on line(s) {lines}"
    namespace: dict = {"__name__": f"docs_{block.page[:-3].replace('-', '_')}_{block.line}"}
    if is_settings(block):
        namespace.update(startproject_settings())
    exec(compile(block.code, str(block), "exec"), namespace)
    if "DBQUEUE" in namespace:
        assert find_problems(namespace["DBQUEUE"]) == [], f"{block} shows a DBQUEUE setting with problems"
    for alias, params in namespace.get("TASKS", {}).items():
        if params.get("BACKEND") == "django_dbqueue.tasks.DatabaseQueueBackend":
            assert task_backend_problems(params) == [], f"{block} shows a TASKS[{alias!r}] with problems"
    for name, value in list(namespace.items()):
        if name.startswith("test_") and inspect.isfunction(value):
            value(
                **{parameter: request.getfixturevalue(parameter) for parameter in inspect.signature(value).parameters}
            )
    return namespace


@pytest.mark.django_db
@pytest.mark.usefixtures("isolated_declarations")
@pytest.mark.parametrize("block", HERE, ids=str)
def test_a_runnable_block_runs_as_pasted(block, request):
    run_block(block, request)


SHOP_TEST_MODULE = """import pytest

CODE = {code!r}


@pytest.mark.django_db
def test_{name}():
    exec(compile(CODE, {where!r}, "exec"), {{"__name__": "docs_block"}})
"""


def test_the_example_shops_blocks_run_in_the_example_project(tmp_path):
    """Blocks that use the shop's models run under the example project's settings and pytest, on this database.

    A block defining tests (a pytest function, a TestCase) is a test module
    as it stands; any other runs inside a test, in a transaction.
    """
    assert SHOP, "no runnable block uses the example shop"
    for block in SHOP:
        assert not (missing := undefined_names(block)), f"{block} uses names it never defines or imports: {missing}"
        name = re.sub(r"\W", "_", str(block))
        defines_tests = re.search(r"^(def test_|class \w+\(.*TestCase\))", block.code, re.M)
        text = block.code if defines_tests else SHOP_TEST_MODULE.format(code=block.code, name=name, where=str(block))
        (tmp_path / f"test_{name}.py").write_text(text)
    env = {**os.environ, "DATABASE_URL": example_database_url(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    shop = ROOT / "example_project"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", shop / "pytest.ini", "--rootdir", shop],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed[1]) >= len(SHOP), done.stdout  # every block ran at least one test


def test_the_marker_stands_before_a_python_block():
    """A marker before anything but a Python fence would mark nothing, silently."""
    misplaced = []
    for page in pages():
        lines = (DOCS / page).read_text().splitlines()
        for index, line in enumerate(lines):
            if line.strip() == MARKER:
                following = next((rest for rest in lines[index + 1 :] if rest.strip()), "")
                if following.strip() != "```python":
                    misplaced.append(f"{page}:{index + 1}")
    assert misplaced == []


def test_the_pages_a_newcomer_reads_first_have_runnable_blocks():
    marked = {block.page for block in RUNNABLE}
    assert {"quickstart.md", "flow-control.md", "schedules.md", "testing.md", "api.md"} <= marked


def test_the_undefined_name_check_sees_inside_functions():
    block = Block("x.md", 1, "import django_dbqueue\n\ndef send(message):\n    send_the_email(message)\n", True)
    assert undefined_names(block) == {"send_the_email"}


@pytest.mark.django_db
@pytest.mark.usefixtures("isolated_declarations")
def test_the_quickstart_reaches_an_acked_message_a_dead_letter_and_its_replay(request, dbqueue, capsys):
    """Steps 3 to 6 in order, with a worker's rules between them, as a newcomer runs them."""
    blocks = [block for block in HERE if block.page == "quickstart.md"]

    def the_block(containing: str) -> Block:
        (found,) = [block for block in blocks if containing in block.code]
        return found

    run_block(the_block('enqueue("emails", {"to": "ada@example.com"}'), request)  # step 3
    run_block(the_block("# shop/queues.py"), request)  # step 4: the handler
    assert dbqueue.run_until_empty("emails") == {"acked": 1}
    assert "Welcome, ada@example.com!" in capsys.readouterr().out

    run_block(the_block('{"to": "not-an-address"}'), request)
    assert dbqueue.run_until_empty("emails") == {"rejected": 1}
    looked = the_block("counts_by_queue()")
    capsys.readouterr()
    run_block(looked, request)
    assert printed_lines(capsys.readouterr().out) == printed_lines("\n".join(shown_output(looked)))
    run_block(the_block("replay("), request)
    assert ArchivedMessage.objects.dead().get().replayed_by == "me"
    assert len(dbqueue.enqueued("emails")) == 1


def shown_output(block: Block) -> list[str]:
    """The output a block shows: the ``# ...`` lines that follow a ``print(...)`` (a loop's too)."""
    shown, after_print = [], False
    for line in block.code.splitlines():
        if after_print and line.startswith("# "):
            shown.append(line[2:])
        elif line.strip():
            after_print = "print(" in line or (after_print and line.startswith(" "))
    return shown


def printed_lines(text: str) -> list[str]:
    """Lines of output with their numbers as N: the ids a database hands out differ from the page's."""
    return [re.sub(r"\d+", "N", line) for line in text.strip().splitlines()]


def test_shown_output_reads_the_comments_after_prints():
    code = "x = 1\n# not output\nprint(x)\n# 1\nfor i in [2]:\n    print(i)\n# 2\n"
    assert shown_output(Block("x.md", 1, code, True)) == ["1", "2"]


@pytest.mark.django_db
def test_the_quickstart_names_every_table_migrate_creates():
    text = (DOCS / "quickstart.md").read_text()
    models = apps.get_app_config("django_dbqueue").get_models()
    tables = {model._meta.db_table for model in models if model._meta.managed and not model._meta.proxy}
    created = tables & set(connection.introspection.table_names())  # what `migrate` made of them
    assert created == tables
    listed = set(re.findall(r"^\| `(dbqueue_\w+)` \|", text, re.M))
    assert listed == created
    count = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen"}.get(len(created), str(len(created)))
    assert f"This creates {count} tables" in text


def test_the_quickstart_states_the_queue_name_limit():
    text = " ".join((DOCS / "quickstart.md").read_text().split())
    assert f"at most {QUEUE_NAME_MAX_LENGTH} characters" in text


def linked_pages(text: str) -> set[str]:
    return {match.rsplit("/", 1)[-1] for match in re.findall(r"\]\((?:docs/)?([\w./-]+\.md)(?:#[\w-]*)?\)", text)}


def test_every_page_is_linked_from_the_readme_or_the_navigation():
    readme = linked_pages((ROOT / "README.md").read_text())
    navigation = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    orphans = [page for page in pages() if page not in readme | navigation]
    assert orphans == []
    unread = [page for page in pages() if page not in readme and page != "index.md"]
    assert unread == [], "README.md lists every page (docs/index.md is the site's home page)"


# --- anchors that work on GitHub and on the site -------------------------------------------
#
# mkdocs build --strict (tox -e docs) checks each link's anchor against the site's own slugs; the
# same pages are read on GitHub, whose slugs differ where a heading holds a run of hyphens or
# spaces (`--until-empty`) or a letter outside ASCII. A link must reach its heading on both.

FENCE = re.compile(r"^\s*(```|~~~)")
ANCHORED_LINK = re.compile(r"\]\(((?:docs/)?[\w.-]*\.md)?#([^)\s]+)\)")


def outside_code(path) -> list[tuple[int, str]]:
    """The lines of a Markdown page that are not in a fenced block, numbered."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def heading_text(heading: str) -> str:
    """What a heading reads as, without its Markdown: a link's text, code without its backticks."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("**", "")


def github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading_text(heading).strip().lower()).replace(" ", "-")


def site_slug(heading: str) -> str:
    """Python-Markdown's toc slugify, mkdocs' default."""
    import unicodedata

    text = unicodedata.normalize("NFKD", heading_text(heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_every_anchor_reaches_its_heading_on_github_and_on_the_site():
    read = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
    headings = {
        path.name: [m.group(1) for _, line in outside_code(path) if (m := re.match(r"#{1,6}\s+(.*?)\s*$", line))]
        for path in read
    }
    broken = []
    for path in read:
        for number, line in outside_code(path):
            for target, anchor in ANCHORED_LINK.findall(line):
                page = target.rsplit("/", 1)[-1] if target else path.name
                found = headings.get(page, [])
                missing = [
                    site
                    for site, slug in (("GitHub", github_slug), ("the site", site_slug))
                    if anchor not in {slug(h) for h in found}
                ]
                if missing:
                    broken.append(f"{path.name}:{number}: #{anchor} of {page} ({', '.join(missing)})")
    assert broken == []


def test_the_slugs_are_githubs_and_the_sites():
    heading = "Held-back messages and `--until-empty` (2026-11-28, [the worker](workers.md))"
    assert github_slug(heading) == "held-back-messages-and---until-empty-2026-11-28-the-worker"
    assert site_slug(heading) == "held-back-messages-and-until-empty-2026-11-28-the-worker"
    assert github_slug("Réglages `PROMETHEUS_MULTIPROC_DIR`") == "réglages-prometheus_multiproc_dir"
    assert site_slug("Réglages `PROMETHEUS_MULTIPROC_DIR`") == "reglages-prometheus_multiproc_dir"
