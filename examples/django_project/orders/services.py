"""Placing an order: the order's row and the call that charges it commit together
(``taskdedup.django.outbox.add``); the call is published after the commit, at least once, and
the task's gate and ``effects()`` make it run once."""

import django_rq
from django.db import transaction

from taskdedup.django import outbox

from .jobs import record_charge_job
from .models import Order
from .tasks import record_charge


def place_order(ref: str, cents: int, *, via: str = "celery") -> str:
    """Create the order and add its charge to the outbox, in one transaction; the id the
    charge runs under (a Celery task id, or an RQ job id with ``via="rq"``)."""
    with transaction.atomic():
        Order.objects.create(ref=ref, cents=cents)
        if via == "rq":
            return outbox.add(django_rq.get_queue("default"), record_charge_job, ref, cents)
        return outbox.add(record_charge.s(ref, cents))
