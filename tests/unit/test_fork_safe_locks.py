"""Module locks a parent's thread holds as another thread forks are free in the child."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from idempotent_tasks import app_store, metrics, prometheus, reserve_and_push
from idempotent_tasks.rq import resources
from idempotent_tasks.stores import redis as redis_store

MODULE_LOCKS = {
    "the Redis store's kept connections": lambda: redis_store._KEPT_LOCK,
    "the app's store and dead-letter queue": lambda: app_store._lock,
    "the in-process counters": lambda: metrics._lock,
    "the Prometheus metrics": lambda: prometheus._lock,
    "kombu's wrapped push": lambda: reserve_and_push._wrap_lock,
    "the keys published lately": lambda: reserve_and_push._recent._lock,
    "RQ's per-process resources": lambda: resources._lock,
}


def _free_in_a_child_forked_while_held(lock: Any) -> bool:
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: try the lock from a thread, so a stuck one cannot hang it
            signal.alarm(5)
            try:
                taken = threading.Event()

                def take() -> None:
                    with lock:
                        taken.set()

                threading.Thread(target=take, daemon=True).start()
                os.write(write, b"ok" if taken.wait(2) else b"no")
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        return os.read(read, 2) == b"ok"
    finally:
        done.set()
        holder.join()
        os.close(read)


# (Python 3.12 on warns of a fork in a process with threads: that is what is tested here.)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("lock_of", MODULE_LOCKS.values(), ids=MODULE_LOCKS.keys())
def test_a_module_lock_held_by_another_thread_at_a_fork_is_free_in_the_child(
    lock_of: Any,
) -> None:
    # Given a module's lock held by one thread of this process, when another thread forks,
    # then the child can take that lock (it would wait forever for a thread it does not have)
    assert _free_in_a_child_forked_while_held(lock_of())
