"""WSGI entry point of the demo shop (gunicorn demo_shop.wsgi)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_shop.settings")
application = get_wsgi_application()
