"""Telling a Redis that cannot take writes for now from a write it will never take.

A dead letter sent to such a Redis (unreachable, a replica during a failover, out of memory, a
cluster reshaping, a failing snapshot) is sent again later with no retry used: the server's
state is not the row's fault. An error reply that waiting does not change (``WRONGTYPE``: the
queue's key holds something else; ``NOPERM``) is the row's to count.
"""

from __future__ import annotations

from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

#: What redis-py raises while the server cannot take writes for now (a server still loading
#: its data raises ``BusyLoadingError``, a ``ConnectionError``).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
    ClusterDownError,
    TryAgainError,
)
#: Such error replies redis-py has no class for: writes refused while snapshots fail to save,
#: a script running too long.
_UNAVAILABLE_REPLIES = ("MISCONF ", "BUSY ")


def is_unavailable(error: BaseException | None) -> bool:
    """Whether ``error``, raised by redis-py, means the server cannot take writes for now."""
    return isinstance(error, UNAVAILABLE) or (
        isinstance(error, ResponseError) and str(error).startswith(_UNAVAILABLE_REPLIES)
    )


def is_refusal(error: BaseException | None) -> bool:
    """Whether ``error`` is an error reply of a Redis that can take writes: the write itself
    is refused, and will be again."""
    return isinstance(error, ResponseError) and not is_unavailable(error)
