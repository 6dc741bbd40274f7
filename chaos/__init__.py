"""The chaos run: a real workload under injected faults, then an audit of what really happened.

``python -m chaos.run`` (``make chaos``) starts a Redis server and a PostgreSQL cluster of its
own, two prefork workers and beat, publishes thousands of keyed tasks (a third of them several
times), SIGKILLs and freezes workers, restarts Redis and PostgreSQL, and then checks from a side
ledger that no body completed twice, that every second start is explained by a crash, that no
key was lost, that no dead letter was re-published twice and that every caller got one value.

Modules: ``run`` (the driver), ``app`` (the workers' Celery app and tasks), ``workload`` (the
keys and their callers), ``faults`` (what is injected when), ``services`` (the servers and
processes it starts), ``ledger`` (the side ledger) and ``audit`` (the checks and the report).
"""

#: Environment of chaos.app (the driver sets it for itself and for every process it starts).
ENV_BROKER_URL = "CHAOS_BROKER_URL"
ENV_BACKEND_URL = "CHAOS_BACKEND_URL"
ENV_STORE_URL = "CHAOS_STORE_URL"
ENV_DLQ_URL = "CHAOS_DLQ_URL"
ENV_LEDGER = "CHAOS_LEDGER"
ENV_LEASE = "CHAOS_LEASE"
ENV_VISIBILITY_TIMEOUT = "CHAOS_VISIBILITY_TIMEOUT"

#: Seconds of a claim's lease: short, so slow tasks outlive it and need their heartbeat.
LEASE_S = 2.0
#: Seconds before Redis hands an unacknowledged message out again: shorter than slow tasks.
VISIBILITY_TIMEOUT_S = 3.0
#: Dead letters: first backoff step, retries, and how often beat sweeps (seconds).
DLQ_BASE_DELAY_S = 0.5
DLQ_MAX_RETRIES = 2
DLQ_POLL_INTERVAL_S = 1.0
#: A dead letter still ``retrying`` after this long (its sweep died) is due again.
DLQ_RETRYING_TIMEOUT_S = 30.0
