"""The partitions a query's plan reads, as one text to search for partition names."""

from django.db import connection


def partition_plan(sql: str, params: list | tuple = ()) -> str:
    """PostgreSQL's EXPLAIN names the partitions it scans; MariaDB/MySQL's EXPLAIN PARTITIONS lists them per table."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"EXPLAIN {sql}", params)
            return "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute(f"EXPLAIN PARTITIONS {sql}", params)
        columns = [c[0] for c in cursor.description]
        return "\n".join(str(dict(zip(columns, row, strict=True))["partitions"]) for row in cursor.fetchall())
