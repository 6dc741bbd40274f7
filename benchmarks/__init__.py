"""Throughput benchmark: plain Celery vs celery-once ``QueueOnce`` vs ``IdempotentTask``.

Run it from the project root with ``make bench`` or ``python -m benchmarks.run``.
"""
