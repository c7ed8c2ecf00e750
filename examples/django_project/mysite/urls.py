"""The project's URLs: a health check, the admin (taskdedup's read-only pages among it) and
one view that places an order through the outbox."""

import json

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from orders.services import place_order


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


@csrf_exempt  # an example API endpoint; a real one authenticates its caller
@require_POST
def orders(request: HttpRequest) -> JsonResponse:
    """``POST /orders/`` with ``{"ref": ..., "cents": ...}``: the order and its charge's call
    commit together; the answer carries the id the charge runs under."""
    data = json.loads(request.body)
    task_id = place_order(str(data["ref"]), int(data["cents"]), via=data.get("via", "celery"))
    return JsonResponse({"ref": data["ref"], "task_id": task_id}, status=201)


urlpatterns = [
    path("health/", health),
    path("orders/", orders),
    path("admin/", admin.site.urls),
]
