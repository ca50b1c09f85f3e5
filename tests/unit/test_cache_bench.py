"""bench/cache_bench.py's arithmetic: which requests count as first copies, cache-served repeats
and joiners, and the hop-by-hop breakdown of the repeats' time."""

from __future__ import annotations

from bench.cache_bench import breakdown, summarize


def test_breakdown_gives_each_hop_and_the_rest():
    timings = [{"queue_ingest": 2.0, "dedup": 1.0, "total": 9.0}, {"queue_ingest": 4.0, "dedup": 3.0, "total": 20.0}]
    # rest per request: 10 - 3 = 7 and 20 - 7 = 13; "total" is not a hop
    assert breakdown([10.0, 20.0], timings) == "p50 ms by hop: queue_ingest 3.0, dedup 2.0, rest 10.0"
    assert breakdown([], []) == ""


def test_summarize_splits_firsts_hits_and_joiners(capsys):
    t = {"queue_ingest": 1.0, "total": 1.0}
    rows = [
        (b"a", 0.000, 0.100, "k:a", t),  # first copy of a, done at 0.100
        (b"a", 0.050, 0.120, "k:a", t),  # a again before a completed: joined the inference
        (b"a", 0.200, 0.210, "k:a", t),  # a after it completed: served from the cache, 10 ms
        (b"b", 0.300, 0.500, "k:b", t),  # first copy of b
    ]
    assert summarize("x", rows, calls=2, unique=2) == 2
    out = capsys.readouterr().out
    assert "requests 4, distinct images 2, unique cache keys 2, engine calls 2" in out
    assert "repeats after completion   n=     1  p50       10.0 ms" in out
    assert "repeats joining in-flight  n=     1  p50       70.0 ms" in out
    assert "first copies                 n=     2" in out
    assert "repeats after completion, p50 ms by hop: queue_ingest 1.0, rest 9.0" in out
