"""Dead-letter backoff: ``base * 2**retry_count`` plus jitter uniform in ``[0, 0.25 * that]``."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from idempotent_tasks.dlq.backoff import JITTER_FRACTION, MAX_DELAY, next_retry_at, retry_delay

NOW = datetime(2024, 5, 17, 12, 30, 45, 123456, tzinfo=timezone.utc)
BASE = 60.0
SEEDS = range(1000)


def _expected_delay(retry_count: int, base: float, seed: int) -> float:
    """The delay the spec prescribes, drawn from a twin of the generator the code gets."""
    delay: float = base * 2**retry_count
    return delay + random.Random(seed).uniform(0, 0.25 * delay)


def test_jitter_fraction_is_a_quarter() -> None:
    assert JITTER_FRACTION == 0.25


@pytest.mark.parametrize("retry_count", [0, 1, 2, 3, 7])
def test_delay_stays_between_the_step_and_a_quarter_more(retry_count: int) -> None:
    step = BASE * 2**retry_count
    delays = [retry_delay(retry_count, BASE, random.Random(seed)) for seed in SEEDS]
    assert all(step <= delay <= 1.25 * step for delay in delays)
    # The jitter is spread over the whole range, not stuck at an end.
    assert min(delays) < step * 1.01
    assert max(delays) > step * 1.24
    assert len(set(delays)) == len(delays)


@pytest.mark.parametrize(("retry_count", "seed"), [(0, 7), (1, 42), (3, 2024)])
def test_delay_for_a_seed_is_the_step_plus_that_seeds_draw(retry_count: int, seed: int) -> None:
    assert retry_delay(retry_count, BASE, random.Random(seed)) == _expected_delay(
        retry_count, BASE, seed
    )


def test_each_retry_doubles_the_step() -> None:
    # Given the same draw for every retry count, the delays double (jitter is proportional)
    delays = [retry_delay(count, BASE, random.Random(5)) for count in range(5)]
    assert delays == pytest.approx([delays[0] * 2**count for count in range(5)])


def test_base_delay_scales_the_delay() -> None:
    assert retry_delay(2, 10.0, random.Random(3)) == pytest.approx(
        retry_delay(2, 1.0, random.Random(3)) * 10
    )


def test_zero_base_delay_means_due_at_once() -> None:
    assert retry_delay(4, 0.0, random.Random(1)) == 0.0
    assert next_retry_at(NOW, 4, 0.0, random.Random(1)) == NOW


@pytest.mark.parametrize("retry_count", [0, 1, 2])
def test_next_retry_at_is_now_plus_the_delay(retry_count: int) -> None:
    expected = NOW + timedelta(seconds=_expected_delay(retry_count, BASE, 99))
    moment = next_retry_at(NOW, retry_count, BASE, random.Random(99))
    assert moment == expected
    assert moment.tzinfo is timezone.utc


def test_next_retry_at_bounds_over_many_seeds() -> None:
    for seed in range(200):
        moment = next_retry_at(NOW, 2, BASE, random.Random(seed))
        assert NOW + timedelta(seconds=4 * BASE) <= moment <= NOW + timedelta(seconds=5 * BASE)


def test_one_generator_gives_a_fresh_draw_each_call() -> None:
    # Given one seeded generator shared by successive items (as a queue shares it)
    rng, twin = random.Random(11), random.Random(11)
    first, second = retry_delay(0, BASE, rng), retry_delay(0, BASE, rng)
    # Then each call consumes the next draw
    assert first == BASE + twin.uniform(0, 0.25 * BASE)
    assert second == BASE + twin.uniform(0, 0.25 * BASE)
    assert first != second


def test_without_a_generator_the_delay_is_still_in_bounds() -> None:
    delays = [retry_delay(1, BASE) for _ in range(200)]
    assert all(2 * BASE <= delay <= 2.5 * BASE for delay in delays)


@pytest.mark.parametrize("retry_count", [31, 32, 40, 1100, 10**6])
def test_delay_is_capped_so_high_retry_counts_still_give_a_moment(retry_count: int) -> None:
    delay = retry_delay(retry_count, BASE, random.Random(1))
    assert 0 < delay <= MAX_DELAY
    assert next_retry_at(NOW, retry_count, 3600.0, random.Random(1)) > NOW
