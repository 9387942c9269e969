"""Check the package as a user gets it, not as the source tree has it (tox -e package).

1. Build the sdist and the wheel (``python -m build``: the wheel is built from
   the sdist, so a file missing from the sdist is missing from the wheel too).
2. ``twine check --strict`` both: the metadata and the README render on PyPI.
3. The wheel holds what the app needs besides its modules: the admin's
   templates and static files, the migrations, the management commands and
   py.typed; and nothing of the repository besides (tests, example project).
4. Install the wheel into a new virtualenv (its dependencies from the index),
   copy the example project to a temporary directory, and run its demo there
   with the source tree off ``sys.path``; then check that ``django_dbqueue``
   was imported from the virtualenv's site-packages, and that Django finds the
   package's admin templates and static files there.

Everything happens in a temporary directory outside the source tree, removed
at the end. Usage: python scripts/check_package.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_dbqueue"

# Run in the virtualenv, from the copied example project, after its demo: where
# django_dbqueue came from, and whether Django finds the app's own files.
AFTER_DEMO = textwrap.dedent(
    """
    import runpy, sys, sysconfig
    from pathlib import Path

    source_tree = Path(sys.argv[1]).resolve()
    on_path = [Path(entry or ".").resolve() for entry in sys.path]
    assert source_tree not in on_path, f"the source tree is on sys.path: {sys.path}"
    sys.argv = ["manage.py", "demo"]
    runpy.run_path("manage.py", run_name="__main__")

    import django_dbqueue
    from django.contrib.staticfiles import finders
    from django.template.loader import get_template

    imported = Path(django_dbqueue.__file__).resolve()
    site_packages = Path(sysconfig.get_path("purelib")).resolve()
    assert imported.is_relative_to(site_packages), f"django_dbqueue imported from {imported}, not {site_packages}"
    assert not imported.is_relative_to(source_tree), f"django_dbqueue imported from the source tree: {imported}"
    for name in ("admin/django_dbqueue/overview.html", "admin/django_dbqueue/deadletter/edit_and_replay.html"):
        origin = Path(get_template(name).origin.name).resolve()
        assert origin.is_relative_to(site_packages), f"template {name} found at {origin}"
    css = finders.find("django_dbqueue/admin.css")
    assert css and Path(css).resolve().is_relative_to(site_packages), f"static django_dbqueue/admin.css found at {css}"
    print(f"\\ndjango-dbqueue {django_dbqueue.__version__} ran from {imported.parent}")
    """
)


def run(*command: str | Path, **kwargs) -> None:
    shown = " ".join("<script>" if "\n" in str(part) else str(part) for part in command)
    print("+", shown, flush=True)
    if subprocess.run([str(part) for part in command], **kwargs).returncode:
        sys.exit(f"failed: {shown}")


def required_files() -> set[str]:
    """The non-module files of the package, as paths inside the wheel."""
    found = {"django_dbqueue/py.typed"}
    for folder in ("templates", "static"):
        found |= {path.relative_to(ROOT).as_posix() for path in (PACKAGE / folder).rglob("*") if path.is_file()}
    found |= {path.relative_to(ROOT).as_posix() for path in (PACKAGE / "migrations").glob("0*.py")}
    found |= {path.relative_to(ROOT).as_posix() for path in (PACKAGE / "management" / "commands").glob("*.py")}
    return found


def check_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(required_files() - names)
    if missing:
        sys.exit(f"{wheel.name} lacks files the app needs: {', '.join(missing)}")
    strays = sorted(name for name in names if name.split("/")[0] in {"tests", "example_project", "docs", "scripts"})
    if strays:
        sys.exit(f"{wheel.name} holds files from outside the package: {', '.join(strays[:10])}")
    print(f"{wheel.name}: {len(names)} files, the templates, static files, migrations and py.typed among them")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dbqueue-package-") as temporary:
        check(Path(temporary).resolve())


def check(work: Path) -> None:
    # Nothing of tox's test set-up: with the source tree on PYTHONPATH, pip would
    # take its django_dbqueue.egg-info for an installed django-dbqueue.
    clean = {key: value for key, value in os.environ.items() if key not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE"}}
    dist = work / "dist"
    run(sys.executable, "-m", "build", "--quiet", "--outdir", dist, ROOT, env=clean)
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        sys.exit(f"expected one sdist and one wheel in {dist}, found {[p.name for p in dist.iterdir()]}")
    run(sys.executable, "-m", "twine", "check", "--strict", sdists[0], wheels[0])
    check_wheel(wheels[0])

    env = work / "venv"
    print(f"+ python -m venv {env}", flush=True)
    venv.create(env, with_pip=True)
    python = env / ("Scripts" if os.name == "nt" else "bin") / "python"
    # django-environ: the example project's settings read the environment with it.
    run(python, "-m", "pip", "install", "--quiet", wheels[0], "django-environ", env=clean)

    project = work / "example_project"
    shutil.copytree(ROOT / "example_project", project, ignore=shutil.ignore_patterns("*.sqlite3*", "__pycache__"))
    clean["DATABASE_URL"] = f"sqlite:///{work / 'demo.sqlite3'}"
    run(python, "manage.py", "migrate", "--noinput", "--verbosity", "0", cwd=project, env=clean)
    run(python, "-c", AFTER_DEMO, ROOT, cwd=project, env=clean)


if __name__ == "__main__":
    main()
