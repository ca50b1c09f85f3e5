"""bench/gpu/throughput.py's harness (InferHandler.handle over in-memory records) with its fake
engine: the GPU check's plumbing, runnable without vLLM or a GPU."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from bench.gpu import throughput


async def test_fake_engine_run_goes_through_the_infer_handler(capsys, monkeypatch):
    calls = []
    real = throughput.fake_engine_class()

    class Counting(real):
        async def ocr(self, images, timeout_s):
            calls.append([img.shape for img in images])
            return await super().ocr(images, timeout_s)

    monkeypatch.setattr(throughput, "fake_engine_class", lambda: Counting)
    args = SimpleNamespace(fake_engine=True, batches=[1, 4], min_images=4, timeout=30.0, model=None)
    assert await throughput.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["engine"] == "fake" and set(result["images_per_s"]) == {"b1", "b4"}
    assert set(result["ratios"]) == {"b4/b1"}
    # one engine call per micro-batch, each page decoded from PNG at full size (896x1152)
    sizes = [len(c) for c in calls]
    assert sizes == [1] * 5 + [4] * 3  # b1: warm-up + 4 timed; b4: warm-up + 8 images (at least 2 batches)
    assert all(shape == (1152, 896, 3) for c in calls for shape in c)
    assert "max_batch   4: 8 requests through InferHandler.handle" in out and "errors 0" in out


def test_missing_lists_pinned_distributions(monkeypatch):
    from bench.gpu import missing

    monkeypatch.setitem(sys.modules, "vllm", None)
    gone = missing.missing({"vllm": "vllm", "json": "json", "aiokafka": "aiokafka"})
    assert gone[0] == "vllm==0.33.0"
    assert "aiokafka==0.12.0" not in gone  # installed here
