"""Claim requests for tests: the fields a test does not care about filled in."""

from __future__ import annotations

import uuid

from idempotent_tasks.records import ClaimRequest


def claim_request(
    *,
    key: str = "k",
    task_name: str = "t",
    storage_key: str | None = None,
    task_id: str = "task-1",
    owner: str | None = None,
    fingerprint: str = "fp",
    lease_seconds: float = 30.0,
    ttl_seconds: float = 60.0,
    **more: object,
) -> ClaimRequest:
    """A claim of ``key`` by ``task_name`` (stored as ``<task_name>:<key>`` unless given),
    under an owner of its own unless given; ``more``: ClaimRequest's other fields."""
    return ClaimRequest(
        storage_key=f"{task_name}:{key}" if storage_key is None else storage_key,
        key=key,
        task_name=task_name,
        task_id=task_id,
        owner=uuid.uuid4().hex if owner is None else owner,
        fingerprint=fingerprint,
        lease_seconds=lease_seconds,
        ttl_seconds=ttl_seconds,
        **more,  # type: ignore[arg-type]
    )
