"""The interface every claim store implements, and the helpers they share."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..records import ClaimRequest, ClaimResult, CompleteOutcome, EncodedResult, Record


@runtime_checkable
class Store(Protocol):
    """Where claims and cached results live. Holds no business logic: each method is one atomic
    step of the claim protocol (one round trip to a server store).

    Every method raises :class:`~idempotent_tasks.errors.StoreUnavailable` when the store cannot
    be reached, and :class:`~idempotent_tasks.errors.CorruptRecord` when a record cannot be read.
    Every write is checked against the caller's ``owner`` and fencing ``token``.
    """

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Atomically claim ``request.storage_key`` for ``request.owner``.

        Acquired when there is no record, when the record is ``processing`` under an expired
        lease or under ``request.previous_owner`` (a takeover: the fencing token is incremented),
        or when it is already held by this very owner (a retried call). Otherwise returns the
        record found: ``MISMATCH`` if validation is on and its fingerprint differs, else
        ``COMPLETED`` or ``IN_PROGRESS``.
        """
        ...

    def complete(
        self, request: ClaimRequest, token: int, result: EncodedResult | None
    ) -> CompleteOutcome:
        """Mark the key ``completed`` with ``result`` for ``request.ttl_seconds``.

        Only while ``request.owner`` still holds ``token``: returns ``STALE`` and writes nothing if
        another owner took over; ``RECOVERED`` if the record had vanished and was written anew.
        ``result=None`` records that the result was not cached (duplicates get ``None``).
        """
        ...

    def release(self, request: ClaimRequest, token: int) -> bool:
        """Delete a ``processing`` claim held by ``request.owner`` with ``token``.

        Returns whether it was deleted; the fencing counter is kept, so tokens keep growing.
        """
        ...

    def extend(self, request: ClaimRequest, token: int) -> bool:
        """Renew the lease to ``request.lease_seconds`` from now; ``False`` if no longer held."""
        ...

    def get(self, storage_key: str) -> Record | None:
        """The record of a key, or ``None`` when there is none (or it expired)."""
        ...

    def forget(self, storage_key: str) -> bool:
        """Delete a key's record whatever its state (an operator's action); whether one existed."""
        ...

    def close(self) -> None:
        """Drop connections; the store reconnects on next use."""
        ...
