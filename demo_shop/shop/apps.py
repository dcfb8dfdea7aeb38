"""The demo shop's inventory app."""

from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "demo_shop.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"
