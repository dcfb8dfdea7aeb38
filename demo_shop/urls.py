"""URLs of the demo shop."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

from demo_shop.shop import views
from distlocks.handler import locks

urlpatterns = [
    path("admin/", admin.site.urls),
    *[path(f"buy/lock:{alias}/<str:product_id>/", views.locked_buy_view(alias)) for alias in locks],
    path("buy/<str:strategy>/<str:product_id>/", views.buy, name="buy"),
    path("health/", views.health, name="health"),
]
