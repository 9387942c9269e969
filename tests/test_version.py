"""The version is written once (django_dbqueue/_version.py) and the built package agrees."""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import django_dbqueue

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_installed_metadata_version_is_the_package_version():
    try:
        installed = metadata.version("django-dbqueue")
    except metadata.PackageNotFoundError:
        pytest.skip("django-dbqueue is not installed (tox installs it; or pip install -e .)")
    assert installed == django_dbqueue.__version__


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads(PYPROJECT.read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    assert module == "django_dbqueue._version"
    assert name == "__version__"
