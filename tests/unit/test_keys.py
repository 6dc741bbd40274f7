"""Keys: validation, per-task derivation, fingerprints, storage names."""

from __future__ import annotations

import enum
import functools
import inspect
import types
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import pytest
from kombu.utils import json as kombu_json

from idempotent_tasks.keys import (
    bind_arguments,
    check_task_id,
    derive_key,
    fingerprint,
    storage_key,
    validate_key,
)


def charge(order_id: int, amount: int, currency: str = "EUR") -> None:
    """A stand-in task body."""


SIGNATURE = inspect.signature(charge)


@pytest.mark.parametrize("bad", [None, 42, 4.2, b"bytes", ["k"], ("k",), {"k": 1}, object()])
def test_non_str_keys_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        validate_key(bad)


def test_keys_with_nul_characters_are_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        validate_key("order\x0042")


def test_keys_and_task_ids_with_a_lone_surrogate_are_refused() -> None:
    # No store's encoding holds one (an undecodable byte of a file name, say)
    with pytest.raises(ValueError, match="lone surrogate"):
        validate_key("file:/data/\udcff")
    with pytest.raises(ValueError, match="UTF-8"):
        check_task_id("task-\udcff")
    assert validate_key("order-\u00e9-\U0001f600") == "order-\u00e9-\U0001f600"


def test_a_task_id_holding_a_nul_is_refused() -> None:
    # PostgreSQL's text refuses NUL: such a call could be neither claimed nor dead-lettered
    with pytest.raises(ValueError, match="NUL"):
        check_task_id("task-\x00-1")


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        validate_key("")


@pytest.mark.parametrize("blank", ["   ", "\n", "\t "])
def test_a_key_of_whitespace_only_is_a_key_like_any_other(blank: str) -> None:
    # SPEC section 2: a key must be a non-empty str, and these are
    assert validate_key(blank) == blank


def test_a_str_key_is_kept_as_is() -> None:
    assert validate_key("order-42") == "order-42"


def test_a_key_of_a_str_subclass_is_its_plain_text() -> None:
    # A str Enum formats as "Color.RED", but the message carries, and the worker reads back,
    # "red": publisher and worker must store it under one name
    class Color(str, enum.Enum):
        RED = "red"

    key = validate_key(Color.RED)
    assert type(key) is str and key == "red"
    assert storage_key("t", key) == storage_key("t", "red")


def test_a_template_whose_format_spec_the_value_does_not_take_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        derive_key("order:{currency:.2f}", SIGNATURE, (42, 990), {})


def test_template_binds_positional_arguments_to_parameter_names() -> None:
    assert derive_key("order:{order_id}:{currency}", SIGNATURE, (42, 990), {}) == "order:42:EUR"
    assert derive_key("order:{order_id}", SIGNATURE, (), {"order_id": 7, "amount": 1}) == "order:7"


def test_template_naming_an_unknown_parameter_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        derive_key("order:{customer}", SIGNATURE, (42, 990), {})


def test_callable_key_gets_args_and_kwargs() -> None:
    def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f"{args[0]}-{kwargs['amount']}"

    assert derive_key(key, SIGNATURE, (42,), {"amount": 5}) == "42-5"


def test_callable_returning_a_non_str_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        derive_key(lambda args, kwargs: 42, SIGNATURE, (1, 2), {})


def test_fingerprint_is_the_same_however_arguments_are_passed() -> None:
    calls = [
        ((42, 990), {}),
        ((42,), {"amount": 990}),
        ((), {"order_id": 42, "amount": 990}),
        ((42, 990, "EUR"), {}),
        ((), {"amount": 990, "order_id": 42, "currency": "EUR"}),
    ]
    prints = {fingerprint("t", SIGNATURE, args, kwargs) for args, kwargs in calls}
    assert len(prints) == 1


def _bound_by_inspect(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return {"args": list(args), "kwargs": dict(kwargs)}
    bound.apply_defaults()
    return dict(bound.arguments)


def _positional_only(a: int, /, b: int = 2) -> None: ...
def _keyword_only(a: int, *, b: int) -> None: ...
def _var_positional(a: int, *rest: int) -> None: ...
def _var_keyword(a: int, **rest: int) -> None: ...
def _defaults(a: int = 1, b: object = None, c: list[int] | None = None) -> None: ...
def _no_parameters() -> None: ...


_SHARED_DEFAULT: list[int] = []


def _mutable_default(a: int, b: list[int] = _SHARED_DEFAULT) -> None: ...


@pytest.mark.parametrize(
    "body",
    [
        charge,
        _positional_only,
        _keyword_only,
        _var_positional,
        _var_keyword,
        _defaults,
        _no_parameters,
        _mutable_default,
    ],
)
def test_arguments_are_bound_exactly_as_signature_bind_binds_them(body: Any) -> None:
    # Plain signatures take a faster path than Signature.bind: the same names, values, order
    # and defaults, and the same fallback for a call that does not fit.
    signature = inspect.signature(body)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}),
        ((1,), {}),
        ((1, 2), {}),
        ((1, 2, "USD"), {}),
        ((1, 2, "USD", 4), {}),
        ((), {"a": 1}),
        ((1,), {"b": 2}),
        ((1,), {"a": 2}),
        ((1,), {"unknown": 2}),
        ((), {"order_id": 1, "amount": 2}),
        ((1,), {"amount": 2, "currency": "USD"}),
        ((1,), {"order_id": 1}),
        ((1,), {"rest": 2}),
        ((), {"c": 3, "a": 1}),
        ((), {"currency": "USD", "amount": 2, "order_id": 1}),
        ((1,), {2: "not a name"}),
        ([1, 2], {}),
    ]
    for args, kwargs in calls:
        bound = bind_arguments(signature, args, kwargs)
        expected = _bound_by_inspect(signature, args, kwargs)
        assert bound == expected and list(bound) == list(expected), (body, args, kwargs)
        # Values and defaults are the very objects given or held, as bind gives them.
        for name, parameter in signature.parameters.items():
            if name in expected and parameter.kind not in (
                parameter.VAR_POSITIONAL,
                parameter.VAR_KEYWORD,
            ):
                assert bound[name] is expected[name], (body, args, kwargs, name)


def test_a_plain_signature_is_bound_without_signature_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("Signature.bind called for a plain signature")

    monkeypatch.setattr(inspect.Signature, "bind", refuse)
    assert bind_arguments(SIGNATURE, (42,), {"amount": 990}) == {
        "order_id": 42,
        "amount": 990,
        "currency": "EUR",
    }


def test_fingerprint_differs_for_other_arguments_or_tasks() -> None:
    base = fingerprint("t", SIGNATURE, (42, 990), {})
    assert fingerprint("t", SIGNATURE, (42, 991), {}) != base
    assert fingerprint("t", SIGNATURE, (42, 990, "USD"), {}) != base
    assert fingerprint("other", SIGNATURE, (42, 990), {}) != base


def test_fingerprint_without_a_fitting_signature_still_works() -> None:
    assert fingerprint("t", None, (1,), {"a": 2}) == fingerprint("t", None, (1,), {"a": 2})
    # Too many arguments for the signature: fall back to raw args, do not crash.
    assert fingerprint("t", SIGNATURE, (1, 2, 3, 4), {}) != fingerprint("t", SIGNATURE, (1, 2), {})


def test_fingerprint_of_values_json_cannot_hold_is_stable() -> None:
    call = ({1, 2, 3}, b"\x00")
    assert fingerprint("t", None, call, {}) == fingerprint("t", None, ({3, 2, 1}, b"\x00"), {})


class Plain:
    """An object without a __repr__ of its own (pickle-serialized tasks carry such)."""

    def __init__(self, value: int) -> None:
        self.value = value


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


def test_fingerprint_of_objects_without_a_repr_of_their_own_is_their_state() -> None:
    assert fingerprint("t", None, (Plain(1),), {}) == fingerprint("t", None, (Plain(1),), {})
    assert fingerprint("t", None, (Plain(1),), {}) != fingerprint("t", None, (Plain(2),), {})
    assert fingerprint("t", None, (Slotted(1),), {}) == fingerprint("t", None, (Slotted(1),), {})
    assert fingerprint("t", None, (Slotted(1),), {}) != fingerprint("t", None, (Slotted(2),), {})


def notify(order: int) -> None:
    """A function passed as an argument (or a parameter's default)."""


def _same_function_elsewhere(function: Any) -> Any:
    """An equal copy of ``function`` at another address, as another process has it."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__)
    copy.__qualname__ = function.__qualname__
    return copy


def charge_with_notifier(order: int, notifier: Any = notify) -> None:
    """A task whose parameter defaults to a function."""


def test_fingerprint_of_functions_and_methods_does_not_hold_their_memory_address() -> None:
    elsewhere = _same_function_elsewhere(notify)
    assert elsewhere is not notify and repr(elsewhere) != repr(notify)
    signature = inspect.signature(charge_with_notifier)
    # A default applied, as each process binds it: the same call in two processes
    assert fingerprint("t", signature, (1,), {}) == fingerprint(
        "t", signature, (1,), {"notifier": elsewhere}
    )
    # Wrapped in a partial (a repr of its own, holding the function's)
    assert fingerprint("t", None, (functools.partial(notify, 1),), {}) == fingerprint(
        "t", None, (functools.partial(elsewhere, 1),), {}
    )
    # Bound methods: of equal objects alike, of others not; builtins by name
    assert fingerprint("t", None, (Plain(1).__init__,), {}) == fingerprint(
        "t", None, (Plain(1).__init__,), {}
    )
    assert fingerprint("t", None, (Plain(1).__init__,), {}) != fingerprint(
        "t", None, (Plain(2).__init__,), {}
    )
    assert fingerprint("t", None, (len,), {}) != fingerprint("t", None, (abs,), {})
    # Other functions differ
    assert fingerprint("t", signature, (1,), {}) != fingerprint(
        "t", signature, (1,), {"notifier": charge_with_notifier}
    )


def test_fingerprint_of_dicts_whose_keys_json_cannot_sort_or_hold() -> None:
    mixed = fingerprint("t", None, ({1: "a", "b": 2, None: 3},), {})
    # As the worker gets them back from JSON: every key text
    assert mixed == fingerprint("t", None, ({"1": "a", "b": 2, "null": 3},), {})
    assert fingerprint("t", None, ({(1, 2): "x"},), {}) != fingerprint(
        "t", None, ({(1, 3): "x"},), {}
    )


class Node:
    """Objects that point at each other (a parent and its children)."""

    def __init__(self) -> None:
        self.children: list[Node] = []
        self.parent: Node | None = None


class OneSlot:
    __slots__ = "value"

    def __init__(self, value: int) -> None:
        self.value = value


def test_fingerprint_never_fails_on_arguments_pickle_carries() -> None:
    parent, child = Node(), Node()
    parent.children.append(child)
    child.parent = parent
    assert len(fingerprint("t", None, (parent,), {})) == 64
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    assert len(fingerprint("t", None, (deep,), {})) == 64
    assert fingerprint("t", None, (OneSlot(1),), {}) != fingerprint("t", None, (OneSlot(2),), {})


def test_fingerprint_sorts_int_keys_as_the_worker_gets_them_back_from_json() -> None:
    assert fingerprint("t", None, ({2: "a", 10: "b"},), {}) == fingerprint(
        "t", None, ({"2": "a", "10": "b"},), {}
    )


def test_short_keys_are_stored_readably_and_scoped_by_task() -> None:
    assert storage_key("shop.charge", "order-42") == "shop.charge:order-42"
    assert storage_key("shop.refund", "order-42") != storage_key("shop.charge", "order-42")


def test_a_colon_in_a_task_name_cannot_make_two_pairs_share_a_name() -> None:
    assert storage_key("a:b", "c") != storage_key("a", "b:c")
    assert storage_key("a%3Ab", "c") != storage_key("a:b", "c")
    assert storage_key("a:b", "x" * 500) != storage_key("a", "b:" + "x" * 498)


def test_long_keys_and_keys_with_braces_are_hashed() -> None:
    long_name = storage_key("shop.charge", "x" * 500)
    assert long_name.startswith("sha256:")
    assert len(long_name) == len("sha256:") + 64
    assert storage_key("shop.charge", "x" * 501) != long_name
    assert storage_key("shop.charge", "{tag}").startswith("sha256:")


def test_a_task_named_like_the_hashed_names_cannot_take_a_hashed_pair_s_name() -> None:
    hashed = storage_key("shop.charge", "x" * 500)
    digest = hashed.removeprefix("sha256:")
    assert storage_key("sha256", digest) != hashed
    assert storage_key("sha256", digest).startswith("sha256:")


class _Money:
    """Sent as what its ``__json__`` gives (kombu's JSON calls it)."""

    def __init__(self, cents: int) -> None:
        self.cents = cents

    def __json__(self) -> dict[str, int]:
        return {"cents": self.cents}


class _LocalDatetime(datetime):
    """A subclass, as pendulum's DateTime or freezegun's FakeDatetime: sent as a datetime."""


class _LocalDate(date):
    pass


class _LocalDecimal(Decimal):
    pass


class _LocalUUID(UUID):
    pass


class _DollarAmount(Decimal):
    """A Decimal whose text is no number: kombu cannot send it as a Decimal."""

    def __str__(self) -> str:
        return f"${Decimal.__str__(self)}"


def test_a_subclass_kombu_cannot_send_as_its_base_type_still_has_a_fingerprint() -> None:
    assert fingerprint("t", None, [_DollarAmount("9.90")], {}) == fingerprint(
        "t", None, [_DollarAmount("9.90")], {}
    )
    assert fingerprint("t", None, [_DollarAmount("9.90")], {}) != fingerprint(
        "t", None, [_DollarAmount("9.91")], {}
    )


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=ZoneInfo("Europe/Paris")),
        datetime(2026, 7, 2, 3, 4, 5, tzinfo=ZoneInfo("UTC")),
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        datetime(2026, 1, 2, 3, 4, 5),
        _Money(990),
        _LocalDatetime(2026, 1, 2, 3, 4, 5, tzinfo=ZoneInfo("Europe/Paris")),
        _LocalDatetime(2026, 1, 2, 3, 4, 5, 6),
        _LocalDate(2026, 1, 2),
        _LocalDecimal("9.90"),
        _LocalUUID("12345678-1234-5678-1234-567812345678"),
    ],
    ids=[
        "zoneinfo",
        "zoneinfo-utc",
        "utc",
        "naive",
        "__json__",
        "datetime subclass",
        "naive datetime subclass",
        "date subclass",
        "Decimal subclass",
        "UUID subclass",
    ],
)
def test_the_publisher_and_the_worker_fingerprint_a_value_alike(value: object) -> None:
    # The worker fingerprints the arguments as they come back from the JSON message
    delivered = kombu_json.loads(kombu_json.dumps([[value], {"note": value}]))
    assert fingerprint("t", None, [value], {"note": value}) == fingerprint(
        "t", None, delivered[0], delivered[1]
    )
