"""Users with chosen permissions and POSTs of the admin's actions, for the admin tests."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User
from django.urls import reverse


def staff(username: str = "ops", *codenames: str) -> User:
    """A staff user holding exactly these django_dbqueue permissions."""
    user = User.objects.create_user(username, password="pw", is_staff=True)
    if codenames:
        perms = Permission.objects.filter(content_type__app_label="django_dbqueue", codename__in=codenames)
        assert perms.count() == len(codenames), f"unknown permission among {codenames}"
        user.user_permissions.set(perms)
    return user


def changelist(model: str) -> str:
    return reverse(f"admin:django_dbqueue_{model}_changelist")


def post_action(client, model: str, action: str, pks, **extra):
    """Submit a list page's action form, as the admin's own page does."""
    data = {"action": action, "_selected_action": [str(pk) for pk in pks], "index": 0, **extra}
    return client.post(changelist(model), data, follow=True)


def user_messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]
