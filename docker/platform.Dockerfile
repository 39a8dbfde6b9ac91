# The control plane: gateway (uvicorn), Celery worker and beat share this image. The training worker builds it
# with REQUIREMENTS=training.txt (adds transformers + PEFT).
FROM python:3.11-slim
ARG REQUIREMENTS=platform.txt

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 DJANGO_SETTINGS_MODULE=quilt.settings.production
RUN apt-get update && apt-get install -y --no-install-recommends libpq5 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements/ requirements/
RUN pip install --no-cache-dir -r requirements/${REQUIREMENTS}
COPY manage.py pyproject.toml ./
COPY platform/ platform/
COPY templates/ templates/
COPY adapters/ adapters/
COPY engine/ engine/
COPY training/ training/
RUN SECRET_KEY=build DATABASE_URL=sqlite:////tmp/build.sqlite3 ALLOWED_HOSTS=localhost \
    QUILT_ENGINE_TOKEN=build-time-placeholder-not-a-secret-000 EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend \
    python manage.py collectstatic --noinput
RUN useradd --create-home quilt && mkdir -p /app/var && chown -R quilt /app/var
USER quilt
EXPOSE 8000
# The gateway, as compose and Kubernetes run it (docker/compose.yaml's gateway): gateway.asgi (the inference API's
# fast path and the ASGI lifespan) under the gateway's HTTP protocol, idle connections kept past a load balancer's,
# and no uvicorn access log (the request log keeps every request under its id; a line each cost 5-36 % more CPU).
CMD ["python", "-m", "uvicorn", "gateway.asgi:application", "--app-dir", "platform", "--http", "httptools", "--loop", "uvloop", "--no-access-log", "--host", "0.0.0.0", "--port", "8000", "--workers", "4", "--timeout-keep-alive", "75"]
