# The demo shop under gunicorn (see docker-compose.yml).
FROM python:3.12-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc pkg-config libmariadb-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -e ".[demo,mysql,postgresql,redis,zookeeper,celery]"
ENV DJANGO_SETTINGS_MODULE=demo_shop.settings
CMD ["sh", "-c", "python manage.py migrate --noinput && gunicorn demo_shop.wsgi:application --workers 4 --bind 0.0.0.0:8000"]
