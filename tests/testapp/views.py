"""Async views that call the async producers, as an ASGI project's views would (tests/test_async_producers.py).

Each takes a JSON body and answers JSON; errors are not caught, so that the
test client raises them in the test.
"""

import json

from django.http import HttpRequest, JsonResponse

import django_dbqueue


def body(request: HttpRequest) -> dict:
    return json.loads(request.body)


async def enqueue(request: HttpRequest) -> JsonResponse:
    data = body(request)
    message = await django_dbqueue.aenqueue(data["queue"], data["payload"], **data.get("options", {}))
    return JsonResponse({"id": message.pk, "created": message.was_created})


async def enqueue_many(request: HttpRequest) -> JsonResponse:
    data = body(request)
    messages = await django_dbqueue.aenqueue_many(data["queue"], data["payloads"], **data.get("options", {}))
    return JsonResponse({"ids": [message.pk for message in messages]})


async def publish(request: HttpRequest) -> JsonResponse:
    data = body(request)
    copies = await django_dbqueue.apublish(data["topic"], data["payload"], **data.get("options", {}))
    return JsonResponse({"copies": {copy.queue: copy.pk for copy in copies}})


async def request(request: HttpRequest) -> JsonResponse:
    data = body(request)
    answer = await django_dbqueue.arequest(data["queue"], data["payload"], timeout=data["timeout"])
    return JsonResponse({"answer": answer})


async def cancel(request: HttpRequest, pk: int) -> JsonResponse:
    result = await django_dbqueue.acancel(pk, by="async view")
    return JsonResponse({"result": result.value})


async def enqueue_then_fail(request: HttpRequest) -> JsonResponse:
    """No transaction in an async view (ATOMIC_REQUESTS refuses them): the message commits before the error."""
    await django_dbqueue.aenqueue("ap-view", {"then": "fail"})
    raise RuntimeError("the view failed after its enqueue")


async def enqueue_task(request: HttpRequest) -> JsonResponse:
    from tests.testapp import tasks  # only with a Tasks framework installed (tests/test_tasks.py skips without)

    data = body(request)
    result = await tasks.add.aenqueue(data["a"], data["b"])
    return JsonResponse({"id": result.id, "status": str(result.status)})


async def task_result(request: HttpRequest, result_id: str) -> JsonResponse:
    from django_dbqueue.tasks.compat import TaskResultStatus
    from tests.testapp import tasks

    result = await tasks.add.aget_result(result_id)
    value = result.return_value if result.status == TaskResultStatus.SUCCESSFUL else None
    return JsonResponse({"status": str(result.status), "return_value": value})
