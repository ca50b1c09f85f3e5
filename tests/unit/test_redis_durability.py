"""Which Redis settings make single flight unsafe (``ocrstream init`` warns about them)."""

import pytest

from services.common.cache import durability_problems

SAFE = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}


def test_aof_every_second_and_noeviction_is_safe():
    assert durability_problems(SAFE) == []
    assert durability_problems(dict(SAFE, appendfsync="always")) == []


@pytest.mark.parametrize("change, problem", [
    ({"appendonly": "no"}, "appendonly is 'no'"),
    ({"appendfsync": "no"}, "appendfsync is 'no'"),
    ({"maxmemory-policy": "allkeys-lru"}, "maxmemory-policy is 'allkeys-lru'"),
    ({"maxmemory-policy": "volatile-ttl"}, "maxmemory-policy is 'volatile-ttl'"),
])
def test_each_unsafe_setting_is_named(change, problem):
    [line] = durability_problems(dict(SAFE, **change))
    assert line.startswith(problem), line


def test_nothing_known_is_two_problems():
    assert [p.split()[0] for p in durability_problems({})] == ["appendonly", "maxmemory-policy"]
