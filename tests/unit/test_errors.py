"""The public errors: one root, and what they say however they are made."""

from __future__ import annotations

import pickle

import pytest

from idempotent_tasks import (
    DeadLettered,
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyKeyMismatch,
    SchemaVersionError,
    StoreUnavailable,
)


@pytest.mark.parametrize(
    "error",
    [
        IdempotencyKeyMismatch("k", "tasks.charge", "fp-1", "fp-2"),
        IdempotencyConflict("k", "tasks.charge", "task-1"),
        DeadLettered("RuntimeError", "boom", "task-1"),
        StoreUnavailable("down"),
        SchemaVersionError("newer"),
    ],
)
def test_every_error_is_an_idempotency_error_and_survives_a_round_trip(error: Exception) -> None:
    assert isinstance(error, IdempotencyError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)


def test_the_errors_we_raise_name_the_key_and_task() -> None:
    mismatch = IdempotencyKeyMismatch("order-42", "tasks.charge", "fp-1", "fp-2")
    assert "'order-42'" in str(mismatch) and "'tasks.charge'" in str(mismatch)
    assert isinstance(mismatch, ValueError)
    conflict = IdempotencyConflict("order-42", "tasks.charge", "task-1")
    assert "'order-42'" in str(conflict) and "task-1" in str(conflict)


@pytest.mark.parametrize("error_class", [IdempotencyKeyMismatch, IdempotencyConflict])
def test_an_error_raised_with_a_message_alone_says_that_message(
    error_class: type[IdempotencyError],
) -> None:
    # As a caller's own code (a stub, a test double) would raise it
    with pytest.raises(error_class, match=r"^busy elsewhere$"):
        raise error_class("busy elsewhere")
    assert pickle.loads(pickle.dumps(error_class("busy elsewhere"))).args[0] == "busy elsewhere"
