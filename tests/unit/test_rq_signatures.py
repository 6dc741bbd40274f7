"""The RQ adapter reads a job function's signature once, not at every enqueue and job."""

from __future__ import annotations

import gc
import inspect

from idempotent_tasks.rq import options
from idempotent_tasks.rq.options import signature_of


def charge(customer: str, amount: int = 0) -> None:
    """A job function."""


class Billing:
    def charge(self, customer: str) -> None:
        """A job method."""


def test_a_functions_signature_is_read_once() -> None:
    # inspect.signature builds a new object at every call: the same one means it was kept
    assert signature_of(charge) is signature_of(charge)
    assert signature_of(charge) == inspect.signature(charge)


def test_a_bound_method_binds_without_its_instance_each_time() -> None:
    for method in (Billing().charge, Billing().charge):
        signature = signature_of(method)
        assert signature is not None
        assert list(signature.parameters) == ["customer"]


def test_a_function_that_goes_takes_its_signature_along() -> None:
    namespace: dict[str, object] = {}
    exec("def short_lived(a):\n    pass\n", namespace)
    function = namespace.pop("short_lived")
    assert signature_of(function) is signature_of(function)
    assert function in options._signatures
    kept = len(options._signatures)
    del function, namespace
    gc.collect()
    assert len(options._signatures) == kept - 1


def test_what_has_no_signature_reads_as_none() -> None:
    assert signature_of(None) is None
    assert signature_of(42) is None
    assert signature_of(print) is not None  # a builtin that has one
