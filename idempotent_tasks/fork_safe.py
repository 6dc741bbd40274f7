"""A lock that a forked child gets afresh.

One thread of a process may hold a lock at the moment another thread forks (a prefork pool
replacing a child, an RQ worker forking a work horse). The child inherits the lock held by a
thread it does not have, and its first use of the lock would wait forever.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeLock:
    """A ``threading.Lock`` for ``with`` blocks, replaced by a free one in a forked child.

    (So a block must not fork: its child would release the free one, and raise.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        renew = weakref.WeakMethod(self._renew)
        os.register_at_fork(after_in_child=lambda: (method := renew()) and method())

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()
