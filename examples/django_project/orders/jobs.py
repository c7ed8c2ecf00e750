"""Functions enqueued on django-rq's queues. ``RQ["QUEUE_CLASS"]`` makes
``django_rq.get_queue("default")`` a ``taskdedup.rq.django.DjangoDedupQueue`` (a
``DedupQueue`` that keeps django-rq's COMMIT_MODE), so::

    queue = django_rq.get_queue("default")
    job = queue.enqueue(reserve_stock, "ORD-1", 2)
    assert queue.enqueue(reserve_stock, "ORD-1", 2).id == job.id   # a duplicate: the original

and ``python manage.py rqworker default`` runs them in a ``taskdedup.rq.DedupWorker``.
"""

from . import ledger


def reserve_stock(order_id: str, quantity: int) -> None:
    """Take ``quantity`` items off the shelf for an order: once per order and quantity."""
    ledger.record(f"stock:{order_id}", quantity)


def record_charge_job(order_ref: str, cents: int) -> dict[str, object]:
    """``orders.tasks.record_charge`` as an RQ job: the same durable record, once."""
    from django.db import transaction

    from taskdedup.django import effects

    from .models import Charge

    with transaction.atomic(), effects() as fx:
        if not fx.first:
            return {**fx.result, "again": True}
        Charge.objects.create(order_ref=order_ref, cents=cents, task_id=fx.task_id)
        ledger.record(f"recorded:{order_ref}", cents)
        fx.result = {"charged": cents}
        return {"charged": cents}
