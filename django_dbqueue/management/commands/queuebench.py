"""Deprecated home of ``manage.py queuebench``, now in the app ``django_dbqueue.contrib.bench``."""

from django_dbqueue.contrib.bench.management.commands import queuebench
from django_dbqueue.management.moved import moved_command

Command = moved_command(queuebench.Command, "django_dbqueue.contrib.bench")
