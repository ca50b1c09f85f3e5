"""bench/infer_bench.py's pure parts: configuration names, balanced images, rates, ratio pairs."""

import hashlib

import pytest

from bench.infer_bench import (REVIEW_CONFIGS, Config, _ratio_pairs, backlog_rate, balanced_images, parse_config,
                               partition_of, summarize)


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


def test_review_configs_give_the_ratios_the_review_asked_for():
    names = [parse_config(c).name for c in REVIEW_CONFIGS.split(",")]
    pairs = {label: (a, b) for label, a, b in _ratio_pairs(names)}
    assert pairs["2 procs/1 proc engine:2x2"] == ("engine:2x2", "engine:1x2")
    assert pairs["2 procs/1 proc pipe:2x2"] == ("pipe:2x2", "pipe:1x2")
    assert pairs["batch on/off pipe:1x1w2"] == ("pipe:1x1w2", "pipe:1x1w2b1")
    assert pairs["pipeline/engine 2x2"] == ("pipe:2x2", "engine:2x2")


def test_summary_prints_all_rounds_next_to_quiet_rounds(capsys):
    def rnd(rate, rest):
        return {"rate": rate, "engine_busy": 0.95, "engine_s_per_img": 1.0, "cpu_infer": 1.0, "cpu_rest_of_machine": rest}

    results = {"engine:1x1": [rnd(1.0, 0.0), rnd(1.0, 0.0), rnd(1.0, 0.0)],
               "pipe:1x1": [rnd(0.9, 0.0), rnd(2.0, 0.5), rnd(0.8, 0.0)]}  # round 2 noisy
    summarize(results, list(results), 3)
    out = capsys.readouterr().out
    # all rounds: median(0.9, 2.0, 0.8) = 0.9; quiet rounds 1 and 3: median(0.9, 0.8) = 0.85
    assert "pipeline/engine 1x1                all 0.900  quiet 0.850 [0.900, 0.800] (2 of 3 rounds)" in out
    assert "pipe:1x1         all 0.900  quiet 0.850 [0.900*, 2.000, 0.800*]" in out
