"""Throughput benchmark: plain Celery vs celery-once ``QueueOnce`` vs ``IdempotentTask``,
with the ceiling a crash-safe effectively-once task can reach (late acks + 3 bare round trips).

Run it from the project root with ``make bench`` or ``python -m benchmarks.run``.
"""
