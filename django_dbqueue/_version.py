"""The version of django-dbqueue, written here and nowhere else.

pyproject.toml reads it (``[tool.setuptools.dynamic]``), so the package's
metadata and ``django_dbqueue.__version__`` cannot disagree. See
docs/versions.md for what the numbers mean.
"""

__version__ = "0.1.0"
