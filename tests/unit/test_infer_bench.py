"""bench/infer_bench.py's pure parts: configuration names, balanced images, rates, ratio pairs."""

import hashlib

import pytest

from bench.infer_bench import (Config, _ratio_pairs, backlog_rate, balanced_images, parse_config, partition_of,
                               summarize)


def test_parse_config_round_trips():
    assert parse_config("engine:1x2") == Config("engine", 1, 2, 1, 0)
    assert parse_config("pipe:2x1w2m8") == Config("pipe", 2, 1, 2, 8)
    for name in ("engine:1x1", "pipe:1x1m4", "pipe:1x1w2", "engine:2x1w2"):
        assert parse_config(name).name == name
    for bad in ("pipe:2", "engine:1x1m4"):  # a window is the pipeline's
        with pytest.raises(ValueError):
            parse_config(bad)


def test_engine_env_is_the_infer_settings():
    env = parse_config("pipe:2x1w2m8").engine_env()
    assert env["OCRSTREAM_RAPIDOCR_THREADS"] == "1"
    assert env["OCRSTREAM_RAPIDOCR_WORKERS"] == "2"
    assert env["OCRSTREAM_MAX_IN_FLIGHT"] == "8"
    assert "OCRSTREAM_MAX_IN_FLIGHT" not in parse_config("pipe:1x1w2").engine_env()  # the engine's default


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
    names = ["engine:1x1", "engine:2x1", "pipe:1x1", "pipe:1x1m8", "pipe:2x1", "pipe:1x2"]
    pairs = {label: (a, b) for label, a, b in _ratio_pairs(names)}
    assert pairs["pipeline/engine 1x1"] == ("pipe:1x1", "engine:1x1")
    assert pairs["pipeline/engine 1x1m8"] == ("pipe:1x1m8", "engine:1x1")  # any window against the same pool
    assert pairs["pipeline/engine 2x1"] == ("pipe:2x1", "engine:2x1")
    assert "pipeline/engine 1x2" not in pairs  # engine:1x2 was not measured
    assert pairs["2 procs/1 proc pipe:2x1"] == ("pipe:2x1", "pipe:1x1")
    assert pairs["2 procs/1 proc engine:2x1"] == ("engine:2x1", "engine:1x1")


def test_mixed_pages_interleave_one_line_images_receipts_and_a4_pages():
    from PIL import Image
    import io

    sizes = [Image.open(io.BytesIO(data)).size for data, _ in balanced_images(8, 4, pages="mixed")]
    assert any(w == 1240 and h > 1700 for w, h in sizes)  # A4 at 150 dpi
    assert any(h < 100 for _, h in sizes)  # one line
    assert len(set(sizes)) >= 3


def test_summary_prints_all_rounds_next_to_quiet_rounds(capsys):
    def rnd(rate, rest):
        return {"rate": rate, "engine_s_per_img": 1.0, "cpu_infer": 1.0, "cpu_rest_of_machine": rest}

    results = {"engine:1x1": [rnd(1.0, 0.0), rnd(1.0, 0.0), rnd(1.0, 0.0)],
               "pipe:1x1": [rnd(0.9, 0.0), rnd(2.0, 0.5), rnd(0.8, 0.0)]}  # round 2 noisy
    summarize(results, list(results), 3)
    out = capsys.readouterr().out
    # all rounds: median(0.9, 2.0, 0.8) = 0.9; quiet rounds 1 and 3: median(0.9, 0.8) = 0.85
    assert "pipeline/engine 1x1                all 0.900  quiet 0.850 [0.900, 0.800] (2 of 3 rounds)" in out
    assert "pipe:1x1         all 0.900  quiet 0.850 [0.900*, 2.000, 0.800*]" in out
