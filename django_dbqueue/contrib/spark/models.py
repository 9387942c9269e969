"""The analytics app's one table: how far each incremental job has read the archive of this database."""

from __future__ import annotations

from django.db import models


class Watermark(models.Model):
    """The last archived row an incremental job processed, by ``(finished_at, id)``, and when it ran.

    One row per job (``queueanalytics``, or ``exportarchive`` and its output
    directory), in the database whose archive the job reads: each database
    alias has its own.
    """

    name = models.CharField(max_length=255, primary_key=True)
    finished_at = models.DateTimeField(help_text="finished_at of the last archived row processed.")
    last_id = models.BigIntegerField(help_text="Its id: rows are ordered by (finished_at, id).")
    run_at = models.DateTimeField(help_text="When the run that set this began.")
    rows = models.BigIntegerField(default=0, help_text="Rows the run read or wrote.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        app_label = "dbqueue_spark"
        db_table = "dbqueue_spark_watermark"
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name}: ({self.finished_at.isoformat()}, {self.last_id})"
