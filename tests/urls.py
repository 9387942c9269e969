from django.contrib import admin
from django.urls import path

from django_dbqueue import metrics
from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics.view),
    # Async views calling the async producers (tests/test_async_producers.py).
    path("async/enqueue", views.enqueue),
    path("async/enqueue-many", views.enqueue_many),
    path("async/publish", views.publish),
    path("async/request", views.request),
    path("async/cancel/<int:pk>", views.cancel),
    path("async/enqueue-then-fail", views.enqueue_then_fail),
    path("async/task", views.enqueue_task),
    path("async/task/<str:result_id>", views.task_result),
]
