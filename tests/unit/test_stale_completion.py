"""An execution whose completion the store refused (its claim was taken over meanwhile) never
hands its own value to callers as the key's."""

from __future__ import annotations

from typing import Any

import pytest

from idempotent_tasks import core, signals
from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.core import Attempt
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.stores import MemoryStore
from tests.claim_requests import claim_request


def _request(owner: str) -> ClaimRequest:
    return claim_request(task_name="tasks.charge", owner=owner, lease_seconds=10.0)


def test_a_refused_completion_whose_winner_cannot_be_read_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an execution whose claim another one (its message redelivered) took over after
    # its lease ended, while it was paused
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    codec = ResultCodec(serializer="json", max_bytes=1024)
    paused = Attempt(store=store, request=_request("paused"), codec=codec)
    assert paused.claim().outcome is Outcome.ACQUIRED
    now[0] += 11
    winner = Attempt(store=store, request=_request("winner"), codec=codec)
    assert winner.claim().outcome is Outcome.ACQUIRED

    # When it finishes, its completion is refused, and the store cannot be read just then
    def unreachable(storage_key: str) -> None:
        raise StoreUnavailable("restarting")

    monkeypatch.setattr(store, "get", unreachable)
    paused.finish("its own value", patience_seconds=1)
    # Then it waits for the key's value as for a live new owner, rather than hand its own out
    assert paused.superseded


def test_a_result_not_cached_is_counted_and_logged_once_however_often_the_store_is_tried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an execution whose result is too big to cache, and a store that is down for its
    # first two completion tries
    store = MemoryStore()
    attempt = Attempt(
        store=store,
        request=_request("owner"),
        codec=ResultCodec(serializer="json", max_bytes=10),
    )
    assert attempt.claim().outcome is Outcome.ACQUIRED
    complete, tries = store.complete, []

    def down_twice(*args: Any, **kwargs: Any) -> Any:
        tries.append(args)
        if len(tries) <= 2:
            raise StoreUnavailable("restarting")
        return complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", down_twice)
    monkeypatch.setattr(core, "MAX_COMPLETE_PAUSE", 0.01)
    reported: list[str] = []

    def on_not_cached(sender: Any = None, **fields: Any) -> None:
        reported.append(fields["reason"])

    signals.result_not_cached.connect(on_not_cached)
    try:
        # When it finishes, the store answering on the third try
        assert attempt.finish("x" * 100, patience_seconds=5) == "x" * 100
    finally:
        signals.result_not_cached.disconnect(on_not_cached)
    # Then the key is completed, and its result not cached was signalled and logged once
    assert len(tries) == 3
    assert len(reported) == 1
    assert sum("is not cached" in message for message in caplog.messages) == 1
