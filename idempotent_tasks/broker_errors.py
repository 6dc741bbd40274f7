"""Telling a broker that cannot take a message for now from one that refuses the message."""

from __future__ import annotations

from kombu.exceptions import OperationalError


def broker_cannot_take(error: BaseException) -> bool:
    """Whether ``error``, raised publishing through Celery, is the broker's state (it cannot be
    reached, or cannot take messages for now) rather than the message's.

    kombu raises a transport's connection and channel errors as ``OperationalError``; for
    Redis that is any error reply too, out of memory and read-only as much as ``WRONGTYPE``
    (the queue's key holds something else), which would refuse the message at every try.
    """
    if not isinstance(error, OperationalError):
        return False
    try:  # redis-py is an optional dependency
        from .redis_unavailable import is_refusal
    except ImportError:
        return True
    return not is_refusal(error.__cause__)
