"""Idempotency keys: validation, per-task derivation, storage names and argument fingerprints."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, time, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

from kombu.utils import json as kombu_json

from . import defaults

#: The ``apply_async`` option a call's key is given in, and the message header it travels in
#: (Celery 5 drops unknown ``apply_async`` options).
KEY_HEADER = "idempotency_key"


def given_key(options: Mapping[str, Any], *, refuse_none: bool = True) -> object:
    """The key a call's publish options give, unchecked: ``idempotency_key=``, else the
    header of that name (the way ``send_task`` carries it); ``None`` for none.

    Raises ``ValueError`` for ``idempotency_key=None`` given, unless not ``refuse_none``:
    anything but a non-empty ``str`` is refused (see :func:`validate_key`). Our own
    re-publishes of a running call (a retry carries its message's headers on) take a ``None``
    for no key, as the worker did."""
    headers = options.get("headers") or {}
    key = options.get(KEY_HEADER)
    if key is None:
        key = headers.get(KEY_HEADER)
    if key is None and refuse_none and (KEY_HEADER in options or KEY_HEADER in headers):
        validate_key(None)
    return key


#: A per-task key: a ``str.format`` template over the call's bound arguments, or a callable
#: ``(args, kwargs) -> str``.
KeySource = str | Callable[[tuple[Any, ...], dict[str, Any]], str]


def validate_key(key: object) -> str:
    """Return ``key`` if it is a non-empty ``str`` without NUL; raise ``ValueError`` otherwise.

    A key of whitespace only is a key like any other (SPEC section 2: any non-empty ``str``).
    """
    if key is None:
        # Given as None (a key computed as None by mistake must not run the call unkeyed).
        raise ValueError(
            "idempotency_key must be a non-empty str, not None (leave the option out for a "
            "call without a key)"
        )
    if not isinstance(key, str):
        raise ValueError(f"idempotency_key must be a non-empty str, not {type(key).__name__}")
    if not key:
        raise ValueError("idempotency_key must be a non-empty str, not an empty one")
    if "\x00" in key:
        # No SQL store or dead-letter table could keep it (PostgreSQL refuses NUL in text).
        raise ValueError("idempotency_key must not contain NUL characters")
    if not _is_utf8(key):
        raise ValueError(
            "idempotency_key must be text UTF-8 can hold, not one with a lone surrogate "
            "(an undecodable byte of a file name, say)"
        )
    # A str subclass (a str Enum, say) as the plain text the message carries and the worker
    # reads back: its own __str__ or __format__ ("K.RED") would make another storage key.
    return str.__str__(key)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: Longest task id a dead letter or an SQL claim row holds (their ``task_id`` columns).
MAX_TASK_ID_CHARS = 255


def check_task_id(task_id: object) -> None:
    """``ValueError`` for a task (or job) id given to a keyed publish that the stores cannot
    hold.

    Refused before anything is published: such a call could be neither claimed in an SQL
    store nor dead-lettered, and would be re-published to try again for ever.
    """
    if task_id is None:
        return
    if not isinstance(task_id, str) or not task_id or not _is_utf8(task_id):
        raise ValueError(f"task_id must be a non-empty str UTF-8 can hold, not {task_id!r}")
    if len(task_id) > MAX_TASK_ID_CHARS:
        raise ValueError(
            f"task_id is {len(task_id)} characters long; at most {MAX_TASK_ID_CHARS} are kept"
        )
    if "\x00" in task_id:
        raise ValueError(f"task_id must hold no NUL character (PostgreSQL refuses it): {task_id!r}")


def fitted(value: str, limit: int, max_bytes: int | None = None) -> str:
    """``value``, or, when longer than ``limit`` characters (or ``max_bytes`` in UTF-8), a
    shorter text naming it: its start and a digest of the whole."""
    too_many_bytes = max_bytes is not None and len(value.encode()) > max_bytes
    if len(value) <= limit and not too_many_bytes:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:32]
    start = value[: limit - len(digest) - 1]
    if max_bytes is not None:
        # Cut at a character's edge: a character of several bytes is not split.
        start = start.encode()[: max_bytes - len(digest) - 1].decode(errors="ignore")
    return f"{start}~{digest}"


def bind_arguments(
    signature: inspect.Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call's arguments to parameter names, defaults applied.

    Falls back to ``{"args": [...], "kwargs": {...}}`` when there is no signature or the call
    does not fit it (the task itself will then fail with Celery's own error).
    """
    if signature is not None:
        layout = _plain_layout(signature)
        if layout is not None:
            arguments = _bind_plain(layout, args, kwargs)
            if arguments is not None:
                return arguments
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.apply_defaults()
            return dict(bound.arguments)
    return {"args": list(args), "kwargs": dict(kwargs)}


#: A signature whose parameters are all plain (positional or keyword): their names in order,
#: and the defaults of those that have one.
_PlainLayout = tuple[tuple[str, ...], dict[str, Any]]
#: The plain layout of each signature seen (``None``: not plain), by id with the signature
#: kept alive beside it. A Celery task's signature is built once; one built anew for every call
#: (RQ's) is not kept once the table is full, rather than push the tasks' out.
_layouts: dict[int, tuple[inspect.Signature, _PlainLayout | None]] = {}
_MAX_LAYOUTS = 256


def _plain_layout(signature: inspect.Signature) -> _PlainLayout | None:
    known = _layouts.get(id(signature))
    if known is not None and known[0] is signature:
        return known[1]
    parameters = signature.parameters.values()
    layout: _PlainLayout | None = None
    if all(parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for parameter in parameters):
        layout = (
            tuple(parameter.name for parameter in parameters),
            {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty},
        )
    if len(_layouts) < _MAX_LAYOUTS:
        _layouts[id(signature)] = (signature, layout)
    return layout


def _bind_plain(
    layout: _PlainLayout, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What ``Signature.bind`` and ``apply_defaults`` give for a call of a plain signature, at
    a tenth of their cost (this runs at every keyed publish and claim); ``None`` when the call
    does not fit it, left to ``bind`` to refuse."""
    names, defaults = layout
    if not isinstance(args, list | tuple) or len(args) > len(names):
        return None
    arguments: dict[str, Any] = {}
    taken = 0
    for index, name in enumerate(names):
        if index < len(args):
            arguments[name] = args[index]
        elif name in kwargs:
            arguments[name] = kwargs[name]
            taken += 1
        elif name in defaults:
            arguments[name] = defaults[name]
        else:
            return None
    # A keyword no parameter takes, or one given positionally too.
    return arguments if taken == len(kwargs) else None


def derive_key(
    source: KeySource,
    signature: inspect.Signature | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """Compute a per-task key from a template or a callable, and validate it."""
    if callable(source):
        return validate_key(source(tuple(args), dict(kwargs)))
    try:
        key = source.format(**bind_arguments(signature, args, kwargs))
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        # TypeError, ValueError: a format spec the value does not take ({amount:.2f}, None)
        raise ValueError(
            f"idempotency_key template {source!r} does not fit the call's arguments: {exc}"
        ) from exc
    return validate_key(key)


def fingerprint(
    task_name: str,
    signature: inspect.Signature | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """Stable SHA-256 of the task name and its arguments bound to parameter names.

    ``f(1, b=2)``, ``f(a=1, b=2)`` and ``f(1, 2)`` give the same fingerprint.
    """
    arguments = bind_arguments(signature, args, kwargs)
    try:
        # Dict keys as the text JSON gives them, which is what the worker gets after the trip:
        # ``{2: "a", 10: "b"}`` then sorts as the worker's ``{"2": "a", "10": "b"}`` does.
        canonical = _CANONICAL.encode([task_name, _with_text_keys(arguments)])
    except (TypeError, ValueError, RecursionError):
        # What the stand-ins cannot encode (an object graph with a cycle, or too deep): its
        # repr, stable enough for the values that reach here.
        canonical = _CANONICAL.encode([task_name, {"__repr__": _repr(arguments)}])
    return hashlib.sha256(canonical.encode()).hexdigest()


#: A memory address in a repr (``<function f at 0x7f...>``, a partial of one): it differs
#: between processes for equal arguments, so it is left out.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _repr(value: Any) -> str:
    """A value's repr without memory addresses."""
    try:
        return _ADDRESS.sub("", repr(value))
    except Exception:
        return f"<{type(value).__name__}>"


def _with_text_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {_key_text(key): _with_text_keys(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_with_text_keys(item) for item in value]
    return value


def _key_text(key: Any) -> str:
    """A dict key as JSON writes it (``1`` → ``"1"``, ``None`` → ``"null"``), else its repr."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    return repr(key)


#: The types kombu's JSON sends by their value (not by ``__json__`` or as JSON's own types).
_KOMBU_TYPES = (datetime, date, time, Decimal, UUID)


def _canonical_default(value: Any) -> Any:
    """JSON stand-in for values JSON cannot hold (tuples are lists already; sets get sorted).

    An object without a ``__repr__`` of its own stands for its type and attributes, not for
    ``object.__repr__``'s memory address, which differs for equal arguments of each call.
    """
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    # As the worker gets them back from a JSON message, so that both sides agree: what an
    # object's ``__json__`` gives (kombu sends that), and a datetime at its fixed UTC offset
    # (kombu sends the offset, not the zone: a ZoneInfo or pytz time comes back at the offset).
    reducer = getattr(value, "__json__", None)
    if callable(reducer):
        return reducer()
    if isinstance(value, _KOMBU_TYPES) and type(value) not in _KOMBU_TYPES:
        # A subclass (pendulum's DateTime, freezegun's FakeDatetime): kombu sends it as its
        # base type, which the worker gets back. (One kombu cannot send so, a Decimal whose
        # str() is no number, say, stands for itself.)
        try:
            value = kombu_json.loads(kombu_json.dumps(value))  # type: ignore[no-untyped-call]
        except Exception:
            pass
    if isinstance(value, datetime) and not isinstance(value.tzinfo, timezone | None):
        offset = value.utcoffset()
        if offset is not None:
            return {"__repr__": repr(value.replace(tzinfo=timezone(offset), fold=0))}
    if inspect.isroutine(value):
        # A function, method or builtin (a parameter's default, often) stands for its name:
        # its repr holds its memory address, which differs from one process to the next.
        named: dict[str, Any] = {"__routine__": _routine_name(value)}
        bound_to = getattr(value, "__self__", None)
        if bound_to is not None and not inspect.ismodule(bound_to):
            named["self"] = bound_to
        return named
    kind = type(value)
    if kind.__repr__ is object.__repr__:  # type: ignore[comparison-overlap]
        state = getattr(value, "__dict__", None)
        if state is None:
            state = {name: getattr(value, name, None) for name in _slot_names(kind)}
        return {"__object__": f"{kind.__module__}.{kind.__qualname__}", "state": state}
    return {"__repr__": _repr(value)}


def _routine_name(routine: Any) -> str:
    module = getattr(routine, "__module__", None)
    if module is None and getattr(routine, "__self__", None) is not None:
        module = type(routine.__self__).__module__  # a builtin method: list.append, say
    name = getattr(routine, "__qualname__", None) or getattr(routine, "__name__", "?")
    return f"{module}.{name}"


def _slot_names(kind: type) -> list[str]:
    """The data slots of a class and its bases (``__slots__`` may be one string)."""
    names: list[str] = []
    for cls in kind.__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__weakref__", "__dict__"):
                names.append(name)
    return names


# Built once: json.dumps with options builds an encoder per call, which costs about as much as
# the encoding itself.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=_canonical_default)


#: What a hashed storage name starts with (then ``:`` and the hex digest).
_HASHED = "sha256"
#: Length of a SHA-256 digest in hex.
_DIGEST_CHARS = 64


def storage_key(task_name: str, key: str) -> str:
    """Name a (task, key) pair for storage: readable when short, its SHA-256 when long.

    The task name's ``%`` and ``:`` are escaped, so no two pairs share a name (task ``a:b``
    with key ``c`` is not task ``a`` with key ``b:c``); names without them stay as they are.
    Braces are never kept, so a Redis Cluster hash tag built around the name stays one tag. A
    task named ``sha256`` is always hashed: its readable names would look like hashed ones.
    """
    task_name = _escaped(task_name)
    scoped = f"{task_name}:{key}"
    readable = len(scoped) <= defaults.KEY_MAX_STORED_CHARS and task_name != _HASHED
    if readable and "{" not in scoped and "}" not in scoped:
        return scoped
    return f"{_HASHED}:" + hashlib.sha256(scoped.encode()).hexdigest()


def may_be_storage_key_of(name: str, task_name: str) -> bool:
    """Whether :func:`storage_key` can give ``name`` for a key of task ``task_name``.

    A store that finds its records by a prefix of their names uses it to leave alone the
    records of a longer prefix: those of prefix ``shop:eu`` also start with ``shop:``, but
    what follows is no name of their own task's.
    """
    hashed = name.startswith(f"{_HASHED}:") and len(name) == len(_HASHED) + 1 + _DIGEST_CHARS
    return hashed or name.startswith(f"{_escaped(task_name)}:")


def _escaped(task_name: str) -> str:
    if ":" in task_name or "%" in task_name:
        return task_name.replace("%", "%25").replace(":", "%3A")
    return task_name
