"""Celery tasks, found by ``app.autodiscover_tasks()``: a gated one next to a plain one, and a
durable one whose database effects happen once (``taskdedup.django.effects``)."""

from celery import shared_task
from django.db import transaction

from taskdedup import Policy
from taskdedup.celery import DedupTask
from taskdedup.django import effects

from . import ledger
from .models import Charge


@shared_task(base=DedupTask, dedup=Policy(ttl=600))
def charge_order(order_id: str, amount_cents: int) -> str:
    """Charge the customer's card: at most once per (order_id, amount_cents) in ten minutes,
    however often a double click or a retried webhook sends it."""
    ledger.record(f"charges:{order_id}", amount_cents)
    return f"charged {amount_cents} for {order_id}"


@shared_task
def send_receipt(order_id: str) -> None:
    """A plain task: every call runs."""
    ledger.record(f"receipts:{order_id}", 1)


@shared_task(base=DedupTask, dedup=Policy(ttl=600), acks_late=True)
def record_charge(order_ref: str, cents: int) -> dict[str, object]:
    """Record the charge of an order in the database, once: the identity's row commits with
    the Charge row or not at all (a redelivered or republished message finds it)."""
    with transaction.atomic(), effects() as fx:
        if not fx.first:
            return {**fx.result, "again": True}
        Charge.objects.create(order_ref=order_ref, cents=cents, task_id=fx.task_id)
        ledger.record(f"recorded:{order_ref}", cents)
        fx.result = {"charged": cents}
        return {"charged": cents}
