"""``idempotent-tasks``: commands that do not run inside Celery (RQ's dead-letter sweep).

``idempotent-tasks rq retry-dead-letters [--redis-url URL] [--dlq-url URL]`` re-enqueues RQ's
due dead letters once and prints how many; run it periodically (see
:mod:`idempotent_tasks.rq.sweep` for cron and ``rq cron`` set-ups).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing

import click
from celery.platforms import EX_UNAVAILABLE
from redis.exceptions import RedisError

from ..dlq.arguments import first_line
from ..dlq.queue import SWEEP_BATCH
from ..errors import SchemaVersionError, StoreUnavailable
from ..setup_errors import SETUP_ERRORS
from .options import DLQ_URL_ENV


@click.group()
def cli() -> None:
    """idempotent_tasks outside Celery."""


@cli.group(name="rq")
def rq_group() -> None:
    """RQ: the dead-letter sweep."""


@rq_group.command(name="retry-dead-letters")
@click.option(
    "--redis-url",
    envvar="RQ_REDIS_URL",
    default="redis://localhost:6379/0",
    show_default=True,
    help="RQ's Redis (also read from RQ_REDIS_URL).",
)
@click.option(
    "--dlq-url",
    envvar=DLQ_URL_ENV,
    default=None,
    help=f"Dead-letter database, an SQLAlchemy URL (also read from {DLQ_URL_ENV}; "
    "default: the local SQLite file).",
)
@click.option(
    "--store-url",
    default=None,
    help="Claim store of queues built with store_url=, for rows whose job RQ no longer has.",
)
@click.option(
    "--batch", type=click.IntRange(min=1, max=100_000), default=SWEEP_BATCH, show_default=True
)
def retry_dead_letters_command(
    redis_url: str, dlq_url: str | None, store_url: str | None, batch: int
) -> None:
    """Re-enqueue every due RQ dead letter once; prints how many were re-enqueued."""
    from redis import Redis

    from .sweep import retry_dead_letters

    try:
        with closing(Redis.from_url(redis_url)) as connection:
            count = retry_dead_letters(connection, dlq_url, batch, store_url=store_url)
    except (StoreUnavailable, SchemaVersionError, RedisError) as exc:
        raise _Unavailable(f"cannot sweep now: {first_line(exc)}") from exc
    except SETUP_ERRORS as exc:  # a driver missing, a URL that does not parse
        raise click.ClickException(f"cannot sweep: {first_line(exc)}") from exc
    click.echo(f"re-enqueued {count} dead letter{'' if count == 1 else 's'}")


class _Unavailable(click.ClickException):
    """A database or Redis that cannot be reached: exit code 69, as the Celery commands."""

    exit_code = EX_UNAVAILABLE


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``idempotent-tasks`` command."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="idempotent-tasks")


if __name__ == "__main__":
    main()
