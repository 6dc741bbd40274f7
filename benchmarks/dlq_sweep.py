"""How fast the dead-letter sweep re-publishes due rows on PostgreSQL, alone and two at once.

    python -m benchmarks.dlq_sweep [--rows 10000] [--batch 100]

Fills a fresh PostgreSQL database (``bench_dead_letters``) with due rows, then runs the sweep
task's body (``idempotent_tasks.retry_dead_letters``) against a Redis broker (db 9): once
alone, then twice at once in two processes over the same rows. Prints rows re-published per
second, checks that every row was published exactly once, and prints the plan of the query
that picks due rows, to show it walks the (status, next_retry_at) index.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from idempotent_tasks.dead_letters import SWEEP_TASK
from idempotent_tasks.dlq import queries
from idempotent_tasks.dlq.queue import DeadLetterQueue
from idempotent_tasks.dlq.schema import dead_letters

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DATABASE = "bench_dead_letters"
DLQ_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
BROKER_URL = "redis://127.0.0.1:6379/9"
QUEUE = "bench-dead-letters"


def make_app() -> Celery:
    """An app whose sweep publishes to the benchmark's broker queue."""
    app = Celery("bench_dlq", broker=BROKER_URL, set_as_current=False)
    app.conf.update(idempotency_dlq_url=DLQ_URL, idempotency_dlq_poll_interval=None)
    app.finalize()
    return app


def fresh_database() -> None:
    engine = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)'))
        connection.execute(sa.text(f'CREATE DATABASE "{DATABASE}"'))
    engine.dispose()


def fill(queue: DeadLetterQueue, rows: int) -> None:
    """Insert ``rows`` due pending rows in bulk (plus some not yet due, to be skipped)."""
    now = datetime.now(timezone.utc)

    def row(index: int, due: bool) -> dict[str, Any]:
        return {
            "id": str(uuid.uuid4()),
            "task_name": "bench.noop",
            "task_id": str(uuid.uuid4()),
            "failure_id": str(uuid.uuid4()),
            "idempotency_key": f"key-{index}",
            "args": [index],
            "kwargs": {},
            "options": {"queue": QUEUE},
            "error_type": "RuntimeError",
            "error_message": "benchmark",
            "traceback": None,
            "retry_count": 0,
            "max_retries": 3,
            "status": "pending",
            "next_retry_at": now - timedelta(seconds=1) if due else now + timedelta(hours=1),
            "created_at": now,
            "updated_at": now,
        }

    queue.ensure_schema()
    with queue.engine.begin() as connection:
        for start in range(0, rows, 1000):
            batch = [row(i, True) for i in range(start, min(start + 1000, rows))]
            connection.execute(sa.insert(dead_letters), batch)
        connection.execute(sa.insert(dead_letters), [row(rows + i, False) for i in range(1000)])
        connection.execute(sa.text(f"ANALYZE {dead_letters.name}"))


def reset_to_due(queue: DeadLetterQueue) -> None:
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    with queue.engine.begin() as connection:
        connection.execute(
            sa.update(dead_letters)
            .where(dead_letters.c.status == "retrying")
            .values(status="pending", sweep_id=None, next_retry_at=past)
        )


def sweep(batch: int) -> tuple[int, float]:
    """Run the sweep task's body once (in this process); re-published count and seconds."""
    app = make_app()
    started = time.perf_counter()
    published = app.tasks[SWEEP_TASK](batch=batch)
    return int(published), time.perf_counter() - started


def published_ids(client: redis.Redis) -> list[str]:
    import json

    ids = []
    for raw in client.lrange(QUEUE, 0, -1):
        ids.append(json.loads(raw)["headers"]["idempotency_dead_letter_id"])
    return ids


def plan(queue: DeadLetterQueue) -> str:
    statement = queries.select_due_ids(datetime.now(timezone.utc), 100)
    compiled = statement.compile(
        dialect=queue.engine.dialect, compile_kwargs={"literal_binds": True}
    )
    with queue.engine.connect() as connection:
        lines = connection.execute(sa.text(f"EXPLAIN {compiled}")).scalars().all()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=100)
    options = parser.parse_args()

    broker = redis.Redis.from_url(BROKER_URL)
    fresh_database()
    queue = DeadLetterQueue(DLQ_URL)
    fill(queue, options.rows)
    query_plan = plan(queue)

    broker.delete(QUEUE)
    alone, alone_seconds = sweep(options.batch)
    alone_ids = published_ids(broker)

    reset_to_due(queue)
    broker.delete(QUEUE)
    context = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    with context.Pool(2) as pool:
        pair = pool.map(sweep, [options.batch, options.batch])
    pair_seconds = time.perf_counter() - started
    pair_ids = published_ids(broker)
    broker.delete(QUEUE)
    queue.dispose()

    def check(ids: list[str]) -> str:
        unique = len(set(ids))
        ok = unique == len(ids) == options.rows
        return "each once" if ok else f"WRONG: {len(ids)} published, {unique} distinct"

    print(f"Dead-letter sweep on PostgreSQL, {options.rows} due rows, batches of {options.batch}")
    print()
    print("| sweep | rows re-published | seconds | rows/s | published |")
    print("|---|---|---|---|---|")
    print(
        f"| one sweep | {alone} | {alone_seconds:.2f} | {alone / alone_seconds:,.0f} "
        f"| {check(alone_ids)} |"
    )
    total = sum(count for count, _ in pair)
    print(
        f"| two sweeps at once | {pair[0][0]} + {pair[1][0]} = {total} | {pair_seconds:.2f} "
        f"| {total / pair_seconds:,.0f} | {check(pair_ids)} |"
    )
    print()
    print("Plan of the due-rows query:")
    print(query_plan)


if __name__ == "__main__":
    main()
