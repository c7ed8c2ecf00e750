"""Celery tasks, found by ``app.autodiscover_tasks()``: a gated one next to a plain one."""

from celery import shared_task

from taskdedup import Policy
from taskdedup.celery import DedupTask

from . import ledger


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
