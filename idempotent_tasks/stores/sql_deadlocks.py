"""Running a SQL store's operation again when the database chose it as a deadlock's victim.

A transaction the server rolls back to break a deadlock (InnoDB's error 1213, PostgreSQL's
40P01) or a serialization failure (40001, MariaDB's 1020) changed nothing: the operation can
simply run again.
InnoDB takes next-key locks for an ``INSERT`` that does nothing on conflict and for a range
``DELETE``, so a claim and the cleanup of expired rows can meet that way even though every
transaction writes claim rows before pickup rows. Failing the claim as an unavailable store
would put the task off for seconds; running it again takes milliseconds.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from ..dlq.engine import driver_codes
from ..errors import StoreUnavailable

logger = logging.getLogger(__name__)

#: Runs of one operation, the first included, before a deadlock is reported as unavailable.
DEADLOCK_RUNS = 5
#: Longest pause before the first run again (seconds); it doubles for each later one.
FIRST_PAUSE = 0.01

#: SQLSTATEs of a transaction rolled back to let another go on (PostgreSQL's psycopg).
_ROLLED_BACK_STATES = frozenset({"40P01", "40001"})
#: MySQL/MariaDB error numbers of the same (PyMySQL and mysqlclient give them first in args):
#: a deadlock (1213), and a row changed since this transaction's snapshot (1020: MariaDB's
#: ``innodb_snapshot_isolation``, on by default since 11.6.2).
_ROLLED_BACK_ERRORS = frozenset({1213, 1020})


class Deadlocked(StoreUnavailable):
    """The database rolled this transaction back to break a deadlock: nothing was written."""


def was_rolled_back_for_another(error: SQLAlchemyError) -> bool:
    """Whether ``error`` is the server rolling the transaction back for another's sake."""
    state, number = driver_codes(getattr(error, "orig", None))
    return state in _ROLLED_BACK_STATES or number in _ROLLED_BACK_ERRORS


Store = TypeVar("Store")
Params = ParamSpec("Params")
Result = TypeVar("Result")


def run_again_after_deadlock(
    operation: Callable[Concatenate[Store, Params], Result],
) -> Callable[Concatenate[Store, Params], Result]:
    """Run a store operation again (after a short random pause) when one of its transactions
    was a deadlock's victim. Only for operations made of transactions that each decide from
    what they read, so a run after a rolled-back one decides afresh."""

    @functools.wraps(operation)
    def run(store: Store, /, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        for attempt in range(DEADLOCK_RUNS - 1):
            try:
                return operation(store, *args, **kwargs)
            except Deadlocked:
                logger.debug("%s was a deadlock's victim; running it again", operation.__name__)
                time.sleep(random.uniform(0, FIRST_PAUSE * 2**attempt))
        return operation(store, *args, **kwargs)  # a deadlock now is reported as unavailable

    return run
