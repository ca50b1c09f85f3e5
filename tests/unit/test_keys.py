"""Cache keys and S3 keys."""

import pytest

from schemas.keys import CacheGeneration, cache_key, image_object_key, result_object_key, split_cache_key
from services.common.settings import EngineIdentity

SHA = "ab" + "0" * 62


def gen(**kw) -> CacheGeneration:
    base = dict(engine="rapidocr", model="m", model_revision="r1", task="ocr", preprocess_version=1)
    base.update(kw)
    return CacheGeneration(**base)


def test_every_generation_field_changes_the_key():
    k = cache_key(SHA, gen())
    for field, value in [("engine", "vllm"), ("model", "m2"), ("model_revision", "r2"), ("task", "table"),
                         ("preprocess_version", 2)]:
        assert cache_key(SHA, gen(**{field: value})) != k, field
    assert cache_key(SHA, gen()) == k


def test_key_shapes():
    k = cache_key(SHA, gen())
    gid, sha = split_cache_key(k)
    assert sha == SHA and len(gid) == 12 and k == f"{gid}:{SHA}"
    assert image_object_key(SHA) == f"images/ab/{SHA}"
    assert result_object_key(k) == f"results/{SHA}/{gid}.json"
    with pytest.raises(ValueError):
        split_cache_key("nonsense")


def test_detector_limit_is_part_of_the_key_and_the_default_key_is_unchanged():
    import hashlib

    default = EngineIdentity().generation("ocr")
    before_options = hashlib.sha256(b"rapidocr|PP-OCRv4-ch|rapidocr-onnxruntime-1.4.4|ocr|1").hexdigest()[:12]
    assert default.options == "" and default.gen_id == before_options  # existing caches stay valid
    fast = EngineIdentity(det_limit_side_len=96).generation("ocr")
    assert fast.options == "det_limit_side_len=96" and fast.gen_id != default.gen_id
    assert EngineIdentity(engine="vllm", det_limit_side_len=96).generation("ocr").options == ""  # rapidocr only


def test_engine_identity_builds_generation():
    g = EngineIdentity(model_revision="x").generation("ocr")
    assert g.model_revision == "x" and g.task == "ocr" and g.engine == "rapidocr"
