from django.contrib import admin

from .models import EmailSent, Invoice, Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["number", "email", "total", "created_at"]
    search_fields = ["number", "email"]


@admin.register(EmailSent)
class EmailSentAdmin(admin.ModelAdmin):
    list_display = ["order", "to", "subject", "sent_at"]


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["number", "order", "amount", "issued_at"]
