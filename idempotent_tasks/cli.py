"""``celery -A proj idempotency ...``: look after keys and dead letters from the shell."""

from __future__ import annotations

import click


@click.group(name="idempotency")
def idempotency() -> None:
    """Inspect and manage idempotency keys and the dead-letter table."""
