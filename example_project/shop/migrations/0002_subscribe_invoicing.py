"""Subscribe queue 'invoicing' to topic 'orders' in the table (queue 'email' does in settings)."""

from django.db import migrations


def subscribe(apps, schema_editor):
    Subscription = apps.get_model("django_dbqueue", "Subscription")
    Subscription.objects.using(schema_editor.connection.alias).get_or_create(topic="orders", queue="invoicing")


def unsubscribe(apps, schema_editor):
    Subscription = apps.get_model("django_dbqueue", "Subscription")
    Subscription.objects.using(schema_editor.connection.alias).filter(topic="orders", queue="invoicing").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("shop", "0001_initial"),
        ("django_dbqueue", "0003_topics_and_stats"),
    ]

    operations = [migrations.RunPython(subscribe, unsubscribe)]
