"""Per-function settings of RQ jobs (the ``@idempotent`` decorator) and what a job carries.

RQ has no task objects to hang options on, so options live on the job function itself: the
decorator stores an :class:`IdempotencyOptions` as ``func.__idempotency__`` and returns the
function unchanged (RQ still imports it by its dotted path). Producers read it when they
enqueue; workers read it again when they run the job.
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

from rq.utils import resolve_function_reference

from .. import defaults
from ..keys import KeySource
from ..settings import positive_seconds

_F = TypeVar("_F", bound=Callable[..., Any])

#: Attribute of a decorated function holding its :class:`IdempotencyOptions`.
OPTIONS_ATTRIBUTE: Final = "__idempotency__"
#: ``job.meta`` entry holding everything idempotent_tasks carries with a job (a dict).
META_KEY: Final = "idempotency"
#: Environment variable naming the dead-letter database (SQLAlchemy URL) of workers and sweeps.
DLQ_URL_ENV: Final = "IDEMPOTENT_TASKS_DLQ_URL"
#: ``DeadLetter.options["framework"]`` of rows written by the RQ adapter.
FRAMEWORK: Final = "rq"
#: The mark of a dead-letter row whose job claims in a store of its own
#: (``IdempotentQueue(store_url=...)``), which only a sweep given that store can send again.
OWN_STORE: Final = "own_store"
#: Longest a duplicate waits inside the worker for the key's owner before it goes back to the
#: end of its queue (seconds; never more than half the job's timeout).
WAIT_SLICE: Final = 10.0

ON_DUPLICATE_CHOICES: Final = ("wait", "skip", "raise")


@dataclass(frozen=True, kw_only=True)
class IdempotencyOptions:
    """How one job function behaves under ``IdempotentQueue`` / ``IdempotentJob``.

    Attributes:
        key: key when an enqueue gives none: a ``str.format`` template over the call's
            arguments bound to parameter names (``"order:{order_id}"``) or a callable
            ``(args, kwargs) -> str``.
        key_required: refuse (``ValueError`` at enqueue) calls that end up without a key.
        ttl: seconds a completed key answers duplicates with its cached result.
        lease: seconds a claim lives without a heartbeat (default: the job's timeout, else 300).
        validate: compare argument fingerprints of calls that share a key.
        on_duplicate: what a job does while another execution holds its key: ``"wait"`` (until
            the owner finishes, then return its value), ``"skip"`` (finish at once with
            ``None``, running nothing) or ``"raise"`` (fail with ``IdempotencyConflict``).
        wait_slice: longest a waiting duplicate stays in the worker before it goes back to the
            end of its queue, freeing the worker (seconds).
        dlq: write the job to the dead-letter table when it fails for good.
        dlq_max_retries: dead-letter retries of this function's jobs.
    """

    key: KeySource | None = None
    key_required: bool = False
    ttl: float = defaults.TTL
    lease: float | None = None
    validate: bool = True
    on_duplicate: str = defaults.ON_DUPLICATE
    wait_slice: float = WAIT_SLICE
    dlq: bool = True
    dlq_max_retries: int = defaults.DLQ_MAX_RETRIES

    def __post_init__(self) -> None:
        if self.on_duplicate not in ON_DUPLICATE_CHOICES:
            raise ValueError(
                f"on_duplicate must be one of {', '.join(ON_DUPLICATE_CHOICES)}, "
                f"not {self.on_duplicate!r}"
            )
        if self.key is not None and not callable(self.key) and not isinstance(self.key, str):
            raise ValueError("key must be a str.format template or a callable (args, kwargs)")
        positive_seconds(self.ttl, "ttl")
        if self.lease is not None:
            positive_seconds(self.lease, "lease")


#: Options of functions that were never decorated.
DEFAULT_OPTIONS: Final = IdempotencyOptions()


@overload
def idempotent(func: _F, /) -> _F: ...


@overload
def idempotent(
    *,
    key: KeySource | None = None,
    key_required: bool = False,
    ttl: float = defaults.TTL,
    lease: float | None = None,
    validate: bool = True,
    on_duplicate: str = defaults.ON_DUPLICATE,
    wait_slice: float = WAIT_SLICE,
    dlq: bool = True,
    dlq_max_retries: int = defaults.DLQ_MAX_RETRIES,
) -> Callable[[_F], _F]: ...


def idempotent(func: Any = None, /, **options: Any) -> Any:
    """Give an RQ job function per-function idempotency options.

    Usable bare (``@idempotent``) or with options (see :class:`IdempotencyOptions`)::

        @idempotent(key="order:{order_id}", ttl=3600, on_duplicate="wait")
        def charge(order_id, amount): ...

        queue.enqueue(charge, 42, 990)                          # key "order:42"
        queue.enqueue(charge, 42, 990, idempotency_key="o-42")  # a per-call key wins

    The function is returned unchanged apart from its ``__idempotency__`` attribute, so RQ
    pickles and imports it by its dotted path as usual. A decorated function is handled by
    ``IdempotentJob`` even when a plain ``rq.Queue`` enqueued it (the key is then derived in
    the worker).

    Raises:
        ValueError: for an unknown ``on_duplicate``, a key that is neither a template nor a
            callable, or a ``ttl`` or ``lease`` that is not a finite number of seconds above 0.
    """
    settings = IdempotencyOptions(**options)

    def decorate(function: _F) -> _F:
        setattr(function, OPTIONS_ATTRIBUTE, settings)
        return function

    if func is not None:
        return decorate(func)
    return decorate


def options_of(func: object) -> IdempotencyOptions | None:
    """The options a function was decorated with, or ``None`` if it never was."""
    found = getattr(func, OPTIONS_ATTRIBUTE, None)
    return found if isinstance(found, IdempotencyOptions) else None


#: Signatures of plain functions, read once each: every enqueue and every job binds its
#: arguments, and ``inspect.signature`` costs more than the binding itself. Weakly keyed, so a
#: function that goes (a reloaded module's) takes its entry along.
_signatures: weakref.WeakKeyDictionary[Callable[..., Any], inspect.Signature] = (
    weakref.WeakKeyDictionary()
)


def signature_of(func: object) -> inspect.Signature | None:
    """The call signature used to bind arguments (``None`` when there is none to read)."""
    if func is None or not callable(func):
        return None
    plain = isinstance(func, types.FunctionType)
    if plain and (known := _signatures.get(func)) is not None:
        return known
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if plain:  # not bound methods (made anew at each look) nor callable objects
        _signatures[func] = signature
    return signature


def scoped_name(func: object) -> str:
    """The name a function's keys are scoped by: RQ's name for it, with the class of the
    instance a bound method or a callable object belongs to (RQ names those by the method's
    name alone, so two classes' ``charge`` methods would share their keys)."""
    instance, func_name = resolve_function_reference(func)
    if instance is None:
        return str(func_name)
    owner = instance if inspect.isclass(instance) else type(instance)  # a classmethod's: the class
    return f"{owner.__module__}.{owner.__qualname__}.{func_name}"
