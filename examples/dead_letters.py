"""Looking after the dead-letter table from Python: python examples/dead_letters.py URL."""

import sys
from datetime import timedelta

from idempotent_tasks.dlq import DeadLetterQueue


def main(url: str) -> None:
    dlq = DeadLetterQueue(url)
    print(dlq.stats())  # counts by status, and 'total'
    for item in dlq.items(status="pending", task_name=None, limit=100):
        print(item.id, item.task_name, item.error_type, item.retry_count, item.next_retry_at)
        dlq.retry_now(item.id)  # due at once: the next sweep re-publishes it
    purged = dlq.purge(status="succeeded", older_than=timedelta(days=7))
    print(f"{purged} succeeded items older than a week purged")


if __name__ == "__main__":
    main(sys.argv[1])
