"""Deprecated home of ``manage.py queueanalytics``, now in the app ``django_dbqueue.contrib.spark``."""

from django_dbqueue.contrib.spark.management.commands import queueanalytics
from django_dbqueue.management.moved import moved_command

Command = moved_command(queueanalytics.Command, "django_dbqueue.contrib.spark")
