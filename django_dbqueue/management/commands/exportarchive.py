"""Deprecated home of ``manage.py exportarchive``, now in the app ``django_dbqueue.contrib.spark``."""

from django_dbqueue.contrib.spark.management.commands import exportarchive
from django_dbqueue.management.moved import moved_command

Command = moved_command(exportarchive.Command, "django_dbqueue.contrib.spark")
