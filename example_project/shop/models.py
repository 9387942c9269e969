"""The shop's business data: orders, and the rows its queue handlers write."""

from django.db import models


class Order(models.Model):
    """Saving a new order enqueues "order placed" in the same transaction (see queues.py)."""

    number = models.CharField(max_length=32, unique=True)
    email = models.CharField(max_length=254)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["number"]

    def __str__(self) -> str:
        return self.number


class EmailSent(models.Model):
    """Written by the 'email' queue's handler: the confirmation it sent."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="emails")
    to = models.CharField(max_length=254)
    subject = models.CharField(max_length=200)
    sent_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["sent_at", "id"]

    def __str__(self) -> str:
        return f"{self.subject} -> {self.to}"


class Invoice(models.Model):
    """Written by the 'invoicing' queue's handler, one per order."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="invoice")
    number = models.CharField(max_length=32, unique=True)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    issued_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["number"]

    def __str__(self) -> str:
        return self.number
