"""An execution whose completion the store refused (its claim was taken over meanwhile) never
hands its own value to callers as the key's."""

from __future__ import annotations

import pytest

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
