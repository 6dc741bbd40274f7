# The example app of docker-compose.yml: a Celery worker or beat with idempotent_tasks.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY idempotent_tasks ./idempotent_tasks
COPY examples ./examples
# kombu[redis] brings what kombu's Redis transport imports besides redis (packaging).
RUN pip install --no-cache-dir ".[redis,sql]" "kombu[redis]"
USER nobody
CMD ["celery", "-A", "examples.compose_app", "worker", "-l", "info"]
