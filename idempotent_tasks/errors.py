"""Every error idempotent_tasks raises, under one root: :class:`IdempotencyError`."""

from __future__ import annotations


class IdempotencyError(Exception):
    """Root of every error raised by idempotent_tasks."""


class IdempotencyKeyMismatch(IdempotencyError, ValueError):
    """The key was already used with different arguments (a different fingerprint).

    Attributes:
        key: the caller's idempotency key.
        task_name: the task the key is scoped to.
        stored_fingerprint: the fingerprint recorded with the first call.
        fingerprint: the fingerprint of this call.
    """

    def __init__(
        self,
        key: str,
        task_name: str | None = None,
        stored_fingerprint: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        # args are the constructor's, so the error survives Celery's result backend. Raised
        # with a message alone (by a caller's own code), it says that message.
        super().__init__(key, task_name, stored_fingerprint, fingerprint)
        self.key = key
        self.task_name = task_name
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint

    def __str__(self) -> str:
        if self.task_name is None:
            return str(self.key)
        return (
            f"idempotency key {self.key!r} of task {self.task_name!r} was first used with other "
            "arguments; use a new key for a different call "
            "(or set idempotency_validate=False on the task)"
        )


class IdempotencyConflict(IdempotencyError):
    """A duplicate arrived while another execution holds the key (``on_duplicate="raise"``).

    Attributes:
        key: the caller's idempotency key.
        task_name: the task the key is scoped to.
        owner_task_id: the Celery task id of the execution holding the key.
    """

    def __init__(
        self, key: str, task_name: str | None = None, owner_task_id: str | None = None
    ) -> None:
        super().__init__(key, task_name, owner_task_id)  # a message alone says that message
        self.key = key
        self.task_name = task_name
        self.owner_task_id = owner_task_id

    def __str__(self) -> str:
        if self.task_name is None:
            return str(self.key)
        return (
            f"idempotency key {self.key!r} of task {self.task_name!r} is being processed "
            f"by task {self.owner_task_id}"
        )


class DeadLettered(IdempotencyError):
    """A task's final failure was written to the dead-letter table after a database outage.

    Ends the message that carried the unwritten failure, with the original error's type and
    message (the original exception object is gone by then).
    """

    def __init__(self, error_type: str, error_message: str, task_id: str) -> None:
        super().__init__(error_type, error_message, task_id)
        self.error_type = error_type
        self.error_message = error_message
        self.task_id = task_id

    def __str__(self) -> str:
        return f"{self.error_type}: {self.error_message} (written to the dead-letter table)"


class StoreUnavailable(IdempotencyError):
    """The idempotency store could not be reached; nothing was run unclaimed."""


class SchemaVersionError(StoreUnavailable):
    """A database's schema is newer than this version of idempotent_tasks understands.

    To this code the database is unusable, as an unreachable one is: a task that meets it is
    tried again later (by upgraded workers, say), never run unclaimed nor lost. A worker whose
    databases are newer refuses to start.
    """


class CorruptRecord(IdempotencyError):
    """A stored record could not be read back (missing fields or an undecodable result)."""


class SideWriteRefused(IdempotencyError):
    """The store refused the value to write beside a completion (a cluster proxy's CROSSSLOT,
    an ACL's NOPERM). The completion itself can be made again without it."""
