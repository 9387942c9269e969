"""Optional apps that build on the queue and that the core never imports.

Each is a Django app of its own, added to ``INSTALLED_APPS`` beside
``django_dbqueue``: `spark` (queue analytics on Spark, the ``spark``
extra) and `bench` (``manage.py queuebench``).
"""
