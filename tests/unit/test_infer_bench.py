"""bench/infer_bench.py's pure parts: configuration names, balanced images, rates, ratio pairs."""

import hashlib

import pytest

from bench.infer_bench import Config, _ratio_pairs, backlog_rate, balanced_images, parse_config, partition_of


def test_parse_config_round_trips():
    assert parse_config("engine:1x2") == Config("engine", 1, 2, 1, 8)
    assert parse_config("pipe:2x1w2b1") == Config("pipe", 2, 1, 2, 1)
    for name in ("engine:1x1", "pipe:1x1b1", "pipe:1x1w2", "engine:2x1w2b4"):
        assert parse_config(name).name == name
    with pytest.raises(ValueError):
        parse_config("pipe:2")


def test_engine_env_is_the_infer_settings():
    env = parse_config("pipe:2x1w2b1").engine_env()
    assert env["OCRSTREAM_RAPIDOCR_THREADS"] == "1"
    assert env["OCRSTREAM_RAPIDOCR_WORKERS"] == "2"
    assert env["OCRSTREAM_MAX_BATCH"] == "1"


def test_partition_of_matches_aiokafka_default_partitioner():
    from aiokafka.partitioner import DefaultPartitioner

    part = DefaultPartitioner()
    for i in range(50):
        key = hashlib.sha256(str(i).encode()).hexdigest()
        assert partition_of(key, 4) == part(key.encode(), [0, 1, 2, 3], [0, 1, 2, 3])


def test_balanced_images_fall_evenly_on_partitions():
    imgs = balanced_images(8, 4)
    assert len({data for data, _ in imgs}) == 8  # all distinct: every one a cache miss
    for data, part in imgs:
        assert partition_of(hashlib.sha256(data).hexdigest(), 4) == part
    assert sorted(part for _, part in imgs) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        balanced_images(6, 4)


def test_backlog_rate_counts_from_submission():
    assert backlog_rate(10.0, [11.0, 12.0, 14.0, 12.5]) == pytest.approx(1.0)


def test_ratio_pairs_pair_like_with_like():
    names = ["engine:1x1", "engine:2x1", "pipe:1x1", "pipe:1x1b1", "pipe:2x1", "pipe:1x2"]
    pairs = {label: (a, b) for label, a, b in _ratio_pairs(names)}
    assert pairs["pipeline/engine 1x1"] == ("pipe:1x1", "engine:1x1")
    assert pairs["pipeline/engine 2x1"] == ("pipe:2x1", "engine:2x1")
    assert "pipeline/engine 1x2" not in pairs  # engine:1x2 was not measured
    assert pairs["batch on/off pipe:1x1"] == ("pipe:1x1", "pipe:1x1b1")
    assert pairs["2 procs/1 proc pipe:2x1"] == ("pipe:2x1", "pipe:1x1")
    assert pairs["2 procs/1 proc engine:2x1"] == ("engine:2x1", "engine:1x1")
