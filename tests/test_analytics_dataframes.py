"""enqueue_dataframe on real Spark: each partition inserts from a Spark Python worker through its own connection."""

import datetime

import pytest

from django_dbqueue import InvalidOption, InvalidQueueName
from django_dbqueue.contrib.spark import enqueue_dataframe
from django_dbqueue.models import Message

# transaction=True: the rows come from Spark's worker processes, and must be gone after the test.
pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]

SCHEMA = "order_id STRING, amount BIGINT, customer STRING"


def orders(spark, ids, partitions=3):
    rows = [(f"order-{i}", i * 10, f"customer-{i % 7}") for i in ids]
    return spark.createDataFrame(rows, SCHEMA).repartition(partitions)


def test_every_row_becomes_a_message_with_its_key_and_payload(spark):
    result = enqueue_dataframe(
        orders(spark, range(2500)), "spark-orders", key_col="order_id", kind="order", batch_size=400
    )
    assert (result.inserted, result.existing) == (2500, 0)
    assert Message.objects.filter(queue="spark-orders", kind="order").count() == 2500
    message = Message.objects.get(queue="spark-orders", key="order-42")
    assert message.payload == {"amount": 420, "customer": "customer-0"}
    assert message.available_at <= message.created_at + datetime.timedelta(seconds=1)


def test_running_the_same_dataframe_twice_creates_no_duplicates(spark):
    frame = orders(spark, range(1200))
    first = enqueue_dataframe(frame, "spark-orders", key_col="order_id", payload_cols=["amount"])
    second = enqueue_dataframe(frame, "spark-orders", key_col="order_id", payload_cols=["amount"])
    assert (first.inserted, first.existing) == (1200, 0)
    assert (second.inserted, second.existing) == (0, 1200)
    # Overlapping data: only the new keys are inserted.
    third = enqueue_dataframe(orders(spark, range(1000, 1500)), "spark-orders", key_col="order_id")
    assert (third.inserted, third.existing) == (300, 200)
    assert Message.objects.filter(queue="spark-orders").count() == 1500
    assert Message.objects.values("key").distinct().count() == 1500
    assert Message.objects.get(key="order-5").payload == {"amount": 50}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"queue": "bad queue!", "key_col": "order_id"}, InvalidQueueName, "bad queue!"),
        ({"key_col": "id"}, InvalidOption, "key_col 'id' is not a column of the DataFrame"),
        ({"key_col": "order_id", "payload_cols": ["amount", "price"]}, InvalidOption, r"\['price'\] are not columns"),
        ({"key_col": "order_id", "payload_cols": []}, InvalidOption, "at least one column"),
        ({"key_col": "order_id", "batch_size": 0}, InvalidOption, "batch_size must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(spark, kwargs, error, message):
    kwargs = {"queue": "spark-orders", **kwargs}
    with pytest.raises(error, match=message):
        enqueue_dataframe(orders(spark, range(10)), kwargs.pop("queue"), **kwargs)
    assert not Message.objects.exists()


def test_bad_rows_fail_the_job_naming_the_problem(spark):
    nulls = spark.createDataFrame([("a", 1), (None, 2)], "order_id STRING, amount BIGINT").coalesce(1)
    with pytest.raises(Exception, match="key_col 'order_id' is NULL in a row"):
        enqueue_dataframe(nulls, "spark-orders", key_col="order_id")
    dates = spark.createDataFrame([("a", datetime.date(2026, 1, 1))], "order_id STRING, due DATE")
    with pytest.raises(Exception, match=r"payload\['due'\] is of type date"):
        enqueue_dataframe(dates, "spark-orders", key_col="order_id")
    assert not Message.objects.exists()
