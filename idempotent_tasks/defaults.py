"""Every default of idempotent_tasks, in one place.

App settings are read from ``app.conf`` under the names in :data:`APP_SETTINGS`; per-task options
of the same meaning win over them, and a per-call option wins over both (see
:func:`idempotent_tasks.settings.resolve`). Durations are in seconds unless a name says otherwise.
"""

from __future__ import annotations

from typing import Any, Final

#: How long a completed key keeps answering duplicates with its cached result.
TTL: Final = 86400
#: Lease of a running claim when the task has no ``time_limit``.
LEASE: Final = 300
#: Prefix of every stored key; two apps sharing a store keep apart by choosing different ones.
KEY_PREFIX: Final = "idempotent_tasks"
#: Results serialized larger than this are not cached (the key still counts as completed).
RESULT_MAX_BYTES: Final = 1024 * 1024
#: Keys longer than this many characters are stored by their SHA-256 instead.
KEY_MAX_STORED_CHARS: Final = 200
#: Serializer of cached results when the task sets none of its own.
RESULT_SERIALIZER: Final = "json"
#: What a worker does with a duplicate while another execution holds the key.
ON_DUPLICATE: Final = "wait"
#: First and longest pause of a waiting duplicate between looks at the owner.
WAIT_INITIAL_DELAY: Final = 0.25
WAIT_MAX_DELAY: Final = 5.0
#: Pause before a task whose store was unreachable is tried again.
STORE_UNAVAILABLE_DELAY: Final = 5.0
#: A body that ran keeps trying to store its result while the store is unreachable for as long
#: as its lease, and at least this long (never past its hard time limit): once the lease ended
#: another execution may take the key over, and fencing then refuses the late completion, so
#: trying on past a short lease only spares a second run (a store restarting, say).
MIN_COMPLETION_PATIENCE: Final = 30.0
#: Seconds after which a queued keyed message no worker claimed counts as lost and is published
#: again, when the broker sets no ``visibility_timeout`` (the Redis transport's own default).
PICKUP_TIMEOUT: Final = 3600
#: Dead-letter queue: base delay, retries and how often beat sweeps it.
DLQ_BASE_DELAY: Final = 60
DLQ_MAX_RETRIES: Final = 3
DLQ_POLL_INTERVAL: Final = 30
#: An item ``retrying`` for longer than this goes back to ``pending`` (its sweep died).
DLQ_RETRYING_TIMEOUT: Final = 3600
#: Pause before a final failure whose dead-letter write failed is written again.
DLQ_WRITE_RETRY_DELAY: Final = 10.0

#: ``app.conf`` name -> default, for every app-level setting.
APP_SETTINGS: Final[dict[str, Any]] = {
    "idempotency_store_url": None,
    "idempotency_dlq_url": None,
    "idempotency_ttl": TTL,
    "idempotency_lease": None,
    "idempotency_key_prefix": KEY_PREFIX,
    "idempotency_result_max_bytes": RESULT_MAX_BYTES,
    "idempotency_result_serializer": None,
    "idempotency_allow_pickle": False,
    "idempotency_pickup_timeout": None,
    "idempotency_publish_in_one_trip": True,
    "idempotency_dlq_base_delay": DLQ_BASE_DELAY,
    "idempotency_dlq_max_retries": DLQ_MAX_RETRIES,
    "idempotency_dlq_poll_interval": DLQ_POLL_INTERVAL,
    "idempotency_dlq_retrying_timeout": DLQ_RETRYING_TIMEOUT,
    "idempotency_dlq_write_retry_delay": DLQ_WRITE_RETRY_DELAY,
}
