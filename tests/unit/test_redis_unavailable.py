"""Which Redis error replies mean "not now" (fail closed, try again later) and which refuse the
write itself, as redis-py's own parser hands them over (it strips the code of the replies it
has a class for)."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis._parsers.base import BaseParser
from redis.client import Pipeline
from redis.exceptions import ResponseError

from idempotent_tasks.errors import CorruptRecord, StoreUnavailable
from idempotent_tasks.redis_unavailable import is_read_only, is_refusal, is_unavailable
from idempotent_tasks.stores.redis import RedisStore, _translated_errors
from tests.claim_requests import claim_request

NOT_NOW = [
    "READONLY You can't write against a read only replica.",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "NOREPLICAS Not enough good replicas to write.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN Hash slot not served",
    "LOADING Redis is loading the dataset in memory",
    # Redis before 7 wraps what a script's redis.call met in an ERR of its own
    "ERR Error running script (call to f_8426): @user_script:6: @user_script: 6: -OOM command "
    "not allowed when used memory > 'maxmemory'.",
    "ERR Error running script (call to f_8426): @user_script:14: @user_script: 14: -READONLY "
    "You can't write against a read only replica.",
]
REFUSED = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOPERM User has no permissions to run the 'evalsha' command",
    "ERR Error running script (call to f_0123): user_script:1: attempt to compare nil",
    "ERR Error running script (call to f_0123): @user_script:3: @user_script: 3: -WRONGTYPE "
    "Operation against a key holding the wrong kind of value",
]


def _in_a_pipeline(reply: str) -> ResponseError:
    """The error as a pipeline (RQ's enqueue, a transaction) raises it: its message prefixed
    with the command, which may hold any text."""
    error = BaseParser.parse_error(reply)
    Pipeline.annotate_exception(None, error, 2, ("RPUSH", "rq:queue:x", "WRONGTYPE caused error: "))
    return error


AS_RAISED = [
    pytest.param(BaseParser.parse_error, id="alone"),
    pytest.param(_in_a_pipeline, id="piped"),
]


@pytest.mark.parametrize("raised", AS_RAISED)
@pytest.mark.parametrize(
    ("reply", "not_now"), [(reply, True) for reply in NOT_NOW] + [(r, False) for r in REFUSED]
)
def test_a_server_that_cannot_take_writes_now_is_told_from_a_refused_write(
    reply: str, not_now: bool, raised: Any
) -> None:
    error = raised(reply)
    assert (is_unavailable(error), is_refusal(error)) == (not_now, not not_now)


@pytest.mark.parametrize("reply", NOT_NOW)
def test_the_store_fails_closed_on_a_server_that_cannot_take_writes_now(reply: str) -> None:
    # (a claim then is tried again later, never taken for a corrupt record to overwrite)
    with pytest.raises(StoreUnavailable), _translated_errors():
        raise BaseParser.parse_error(reply)


def test_the_store_takes_a_key_of_another_type_for_a_corrupt_record() -> None:
    with pytest.raises(CorruptRecord), _translated_errors():
        raise BaseParser.parse_error(REFUSED[0])


@pytest.mark.parametrize(
    ("reply", "read_only"),
    [(NOT_NOW[0], True), (NOT_NOW[-1], True), (NOT_NOW[-2], False), (REFUSED[0], False)],
)
def test_a_replicas_refusal_is_told_also_inside_an_old_redis_script_error(
    reply: str, read_only: bool
) -> None:
    # (the store's kept connection is then made again, to reach the new master)
    assert is_read_only(BaseParser.parse_error(reply)) is read_only


@pytest.mark.parametrize("reply", [0, -1])
def test_a_claim_answered_with_no_token_is_refused_not_acquired(
    reply: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The usual claim's answer is its token alone (from 1 up): any other number is no claim's
    # answer, and must never pass for one (a fencing token of 0 would hold the key).
    store = RedisStore(redis.Redis(port=1), prefix="t")  # never connects: the script is faked
    monkeypatch.setattr(store, "_run", lambda *_: reply)
    with pytest.raises(CorruptRecord, match="not a token"):
        store.claim(
            claim_request(
                task_id="id",
                owner="o",
                fingerprint="f",
                lease_seconds=1.0,
                ttl_seconds=1.0,
            )
        )
