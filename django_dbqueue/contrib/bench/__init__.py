"""``manage.py queuebench``: how fast the queue is on this database, against a raw-SQL ceiling.

`runner` runs the phases and prints the table; `rawsql` is the
same protocol written straight against the driver (the ceiling our ORM code
is measured against); `roles` holds what the benchmark's child
processes run.
"""
