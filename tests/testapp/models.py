"""Business models the tests save next to messages (the transactional outbox)."""

from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=32, unique=True)
    total = models.DecimalField(max_digits=10, decimal_places=2, default=0)

    def __str__(self) -> str:
        return self.number
