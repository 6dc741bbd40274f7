"""Telling a Redis that cannot take writes for now from a write it refuses.

A server unreachable, a replica during a failover, out of memory, failing to save snapshots,
busy with a script that will not end, short of replicas, or a cluster reshaping: asked again
later, it may well answer. Callers then fail closed and try again (a claim, a dead letter's
publish) with nothing counted against the call. An error reply that waiting does not change
(``WRONGTYPE``: the key holds something else; ``NOPERM``; a script's error) is the write's own.
"""

from __future__ import annotations

import re

from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

#: Errors redis-py raises for a server that cannot take writes for now. It strips the code from
#: the replies it has a class for (``READONLY``, ``OOM``, ``TRYAGAIN``, ``CLUSTERDOWN``,
#: ``MASTERDOWN``, a ``ClusterDownError``; ``LOADING``, a ``ConnectionError``), hence classes.
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
    ClusterDownError,
    TryAgainError,
)
#: The codes of such replies, for those it keeps whole (and for redis-py versions with fewer
#: classes).
_UNAVAILABLE_CODES = frozenset(
    {
        "READONLY",
        "OOM",
        "MISCONF",
        "BUSY",
        "NOREPLICAS",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "LOADING",
    }
)


def is_unavailable(error: BaseException | None) -> bool:
    """Whether ``error``, raised by redis-py, means the server cannot take writes for now."""
    if isinstance(error, _UNAVAILABLE_ERRORS):
        return True
    return isinstance(error, ResponseError) and _code(error) in _UNAVAILABLE_CODES


#: A Redis before 7 wraps the error a script's ``redis.call`` met in an ``ERR`` of its own:
#: "Error running script (call to f_…): @user_script:4: @user_script: 4: -OOM command not …".
_SCRIPT_ERROR_CODE = re.compile(r"@user_script: ?\d+: -([A-Z]+)\b")


def _code(error: ResponseError) -> str:
    """The code of an error reply: redis-py's ``status_code`` when it kept one (that of the
    error a script met, when a Redis before 7 wrapped it in an ``ERR``), else the reply's first
    word, after the prefix a pipeline puts before it ("Command # 2 (…) of pipeline caused
    error: MISCONF …"; the last such phrase: the command may hold any text)."""
    code = getattr(error, "status_code", None)
    text = str(error)
    if code in (None, "", "ERR"):
        in_script = _SCRIPT_ERROR_CODE.search(text)
        if in_script is not None:
            return in_script.group(1)
    if code:
        return str(code)
    _, annotated, reply = text.rpartition(" of pipeline caused error: ")
    return (reply if annotated else text).split(" ", 1)[0]


def is_read_only(error: BaseException) -> bool:
    """Whether ``error`` is a replica's refusal (``READONLY``: a master demoted by a failover),
    also when a Redis before 7 wrapped it in a script's error."""
    return isinstance(error, ReadOnlyError) or (
        isinstance(error, ResponseError) and _code(error) == "READONLY"
    )


def is_refusal(error: BaseException | None) -> bool:
    """Whether ``error`` is an error reply of a Redis that can take writes: the write itself
    is refused, and would be again."""
    return isinstance(error, ResponseError) and not is_unavailable(error)
