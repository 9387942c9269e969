"""QueueStat in the admin: listed, filterable, never edited by hand (queueanalytics replaces the rows)."""

from datetime import UTC, datetime

import pytest

from django_dbqueue.models import QueueStat

pytestmark = pytest.mark.django_db


def test_figures_are_listed_read_only(admin_client):
    hour = datetime(2026, 3, 1, 2, tzinfo=UTC)
    stat = QueueStat.objects.create(hour=hour, queue="orders", kind="invoice", acked=4567891, wait_p95=1.5)
    QueueStat.objects.create(hour=hour, queue="emails", acked=9876543)
    page = admin_client.get("/admin/django_dbqueue/queuestat/?queue=orders")
    assert page.status_code == 200
    text = page.content.decode()
    assert "4567891" in text and "9876543" not in text
    assert admin_client.get("/admin/django_dbqueue/queuestat/add/").status_code == 403
    detail = admin_client.get(f"/admin/django_dbqueue/queuestat/{stat.pk}/change/")
    assert detail.status_code == 200 and 'name="_save"' not in detail.content.decode()
