"""The orders app's tables: an order, and the charges the durable task records for it."""

from django.db import models


class Order(models.Model):
    ref = models.CharField(max_length=64, unique=True)
    cents = models.IntegerField()

    def __str__(self) -> str:
        return self.ref


class Charge(models.Model):
    """A charge recorded by ``record_charge`` (no unique constraint on the order: a body that
    ran twice would show as a second row; ``taskdedup.django.effects`` keeps it at one)."""

    order_ref = models.CharField(max_length=64)
    cents = models.IntegerField()
    task_id = models.CharField(max_length=255, null=True)
