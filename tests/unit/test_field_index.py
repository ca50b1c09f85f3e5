"""The field index's keys and pure helpers (services/common/cache/field_index.py, schemas/keys.py): which
entries a LIST offers for a set of fields, and which entry holds them. The S3 calls themselves
are checked on the real stack (tests/integration/test_tasks.py)."""

from __future__ import annotations

from schemas.keys import CacheGeneration, cache_key, field_family_id, field_index_key, field_index_prefix
from services.common.cache.field_index import candidates, entry_body, holds

SHA = "ab" * 32
BASE = dict(engine="openai", model="tencent/HunyuanOCR", model_revision="main", preprocess_version=1,
            options="prompt=1a2b3c")
THREE = CacheGeneration(task="extract:aaaaaaaaaaaa", **BASE)
TWO = CacheGeneration(task="extract:bbbbbbbbbbbb", **BASE)


def test_extractions_of_other_fields_are_one_family_and_anything_else_another():
    assert field_family_id(THREE) == field_family_id(TWO) == CacheGeneration(task="extract", **BASE).gen_id
    assert field_family_id(THREE) != THREE.gen_id
    for change in ({"model_revision": "v2"}, {"options": "prompt=ffffff"}, {"preprocess_version": 2},
                   {"model": "other"}, {"engine": "vllm"}):
        assert field_family_id(THREE.model_copy(update=change)) != field_family_id(THREE)
    ocr = CacheGeneration(task="ocr", **BASE)
    assert field_family_id(ocr) == ocr.gen_id  # no field list: its own id


def test_index_keys_name_the_image_family_scope_count_and_generation():
    fam = field_family_id(THREE)
    assert field_index_prefix(SHA, fam) == f"fieldsets/{SHA}/{fam}/"
    assert field_index_prefix(SHA, fam, "kabc") == f"fieldsets/{SHA}/{fam}.kabc/"
    assert field_index_key(cache_key(SHA, THREE), fam, 3) == f"fieldsets/{SHA}/{fam}/3-{THREE.gen_id}.json"
    assert field_index_key(cache_key(SHA, THREE, "kabc"), fam, 3) == \
        f"fieldsets/{SHA}/{fam}.kabc/3-{THREE.gen_id}.json"


def test_candidates_skip_smaller_sets_the_requests_own_key_and_odd_names_smallest_then_newest_first():
    p = "fieldsets/x/y/"
    listing = [(f"{p}5-aaaaaaaaaaaa.json", 100), (f"{p}2-bbbbbbbbbbbb.json", 300), (f"{p}3-cccccccccccc.json", 200),
               (f"{p}3-dddddddddddd.json", 400), (f"{p}1-eeeeeeeeeeee.json", 500), (f"{p}3-ffffffffffff.json", 900),
               (f"{p}notes.txt", 999), (f"{p}x-aaaaaaaaaaaa.json", 999)]
    assert candidates(listing, 2, "ffffffffffff") == [
        f"{p}2-bbbbbbbbbbbb.json", f"{p}3-dddddddddddd.json", f"{p}3-cccccccccccc.json", f"{p}5-aaaaaaaaaaaa.json"]
    assert candidates(listing, 6, "") == [] and candidates([], 1, "") == []


def test_an_entry_holds_a_field_set_when_it_names_every_field_of_this_image_and_scope():
    key = cache_key(SHA, THREE)
    raw = entry_body(key, ["total", "date", "seller", "date"])
    assert raw == ('{"cache_key":"%s","fields":["date","seller","total"]}' % key).encode()
    assert holds(raw, ("total", "date"), SHA, None) == key
    assert holds(raw, ("date", "seller", "total"), SHA, None) == key
    assert holds(raw, ("total", "iban"), SHA, None) is None
    assert holds(raw, ("total",), "cd" * 32, None) is None  # another image's entry
    assert holds(raw, ("total",), SHA, "kabc") is None  # another scope's
    assert holds(entry_body(cache_key(SHA, THREE, "kabc"), ["total"]), ("total",), SHA, "kabc") is not None
    for bad in (b"", b"[]", b'{"cache_key": "x", "fields": []}', b'{"fields": ["total"]}',
                b'{"cache_key": "%s", "fields": "total"}' % key.encode()):
        assert holds(bad, ("total",), SHA, None) is None
