"""``s3://`` references on the real stack: ingest reads only under the allow-list (default: the
bucket's ``uploads/``), refuses the rest unread with ``image_uri_not_allowed``; the CLI uploads
there, refuses a file over the byte limit before uploading anything; ``init`` sets the upload
prefix's lifecycle rule."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid

import orjson
import pytest
from botocore.exceptions import ClientError

from schemas.errors import ErrorCode
from schemas.events import SubmitEvent
from schemas.keys import image_object_key
from services.cli.client import Submitter
from services.common.errors import OcrError
from services.common.codec import dumps
from services.common.s3 import upload_rule_id
from services.common.settings import CommonSettings, Limits
from tests.conftest import text_image
from tests.integration.test_request_ids import KafkaDoor, printable_tag, reads
from tests.stack import REPO, metric_value

pytestmark = pytest.mark.stack


@pytest.fixture
def other_bucket(s3):
    """A second bucket on the same MinIO, readable with the same credentials; removed afterwards."""
    name = f"ocrstream-other-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    yield name
    for obj in s3.list_objects_v2(Bucket=name).get("Contents", []):
        s3.delete_object(Bucket=name, Key=obj["Key"])
    s3.delete_bucket(Bucket=name)


def _exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError:
        return False


async def test_references_outside_the_allow_list_end_unread_and_the_next_goes_through(pipeline, s3, other_bucket):
    tag = printable_tag()
    bucket = s3.bucket
    secret = text_image(["SECRET 933745"])
    placed = {(bucket, f"results/reqids-{tag}/doc.png"), (other_bucket, f"uploads/reqids-{tag}.png")}
    for b, k in placed:
        s3.put_object(Bucket=b, Key=k, Body=secret)
    before = {(b, k): s3.head_object(Bucket=b, Key=k) for b, k in placed}
    refs = {
        "results": f"s3://{bucket}/results/reqids-{tag}/doc.png",
        "other_bucket": f"s3://{other_bucket}/uploads/reqids-{tag}.png",
        "percent": f"s3://{bucket}/uploads/%2e%2e/results/reqids-{tag}/doc.png",
        "double_slash": f"s3://{bucket}//results/reqids-{tag}/doc.png",
        "bucket_suffix": f"s3://{bucket}x/uploads/reqids-{tag}.png",
    }
    gets = metric_value(pipeline.metrics("ingest"), "ocrstream_store_call_seconds_count", store="s3", op="get")
    async with KafkaDoor() as door:
        ids = {name: f"ref-{name.replace('_', '-')}-{uuid.uuid4().hex[:8]}" for name in refs}
        for name, uri in refs.items():
            await door.send(dumps(SubmitEvent(request_id=ids[name], image_uri=uri)))
        dots = f"ref-dots-{uuid.uuid4().hex[:8]}"  # a literal '..' segment: the submit schema refuses it already
        await door.send(orjson.dumps({"request_id": dots, "image_uri": f"s3://{bucket}/uploads/../results/x"}))
        docs = await door.collect(set(ids.values()) | {dots})
    for name, uri in refs.items():
        doc = docs[ids[name]]
        assert doc.status == "error" and doc.error.code is ErrorCode.IMAGE_URI_NOT_ALLOWED, (name, doc.error)
        assert f"ingest reads only under s3://{bucket}/uploads/" in doc.error.message or \
            doc.error.message == (f"image_uri {uri!r} is outside the S3 locations ingest may read: "
                                  f"s3://{bucket}/uploads/ (OCRSTREAM_S3_ALLOWED_PREFIXES)"), (name, doc.error)
    assert docs[dots].error.code is ErrorCode.INVALID_REQUEST and "'..'" in docs[dots].error.message
    # not one S3 read for them, and the objects are as they were
    assert metric_value(pipeline.metrics("ingest"), "ocrstream_store_call_seconds_count", store="s3", op="get") == gets
    for (b, k), head in before.items():
        now = s3.head_object(Bucket=b, Key=k)
        assert (now["ETag"], now["LastModified"]) == (head["ETag"], head["LastModified"])
    assert not _exists(s3, bucket, image_object_key(hashlib.sha256(secret).hexdigest()))  # never ingested

    # the next one, through the upload prefix (what the CLI does with a file too large to inline), goes through
    s = CommonSettings()
    submitter = Submitter(s.model_copy(update={"limits": Limits(inline_max_bytes=0)}))
    data = text_image(["UPLOADED 323788"])
    async with KafkaDoor() as door:
        await submitter.start()
        try:
            rid = await submitter.submit_bytes(data, filename="up.png")
        finally:
            await submitter.stop()
        doc = (await door.collect({rid}))[rid]
    assert doc.status == "ok" and reads(doc.text, "UPLOADED 323788")
    assert _exists(s3, bucket, f"uploads/{hashlib.sha256(data).hexdigest()}")


async def test_an_overlong_reference_and_a_negative_submit_time_are_input_errors(pipeline):
    """Before: an ``s3://`` URI of 5,000 characters ended ``internal_error`` (S3 refused the key
    after the stage had tried it), and ``submitted_at_ms`` -5 was accepted and skewed the request's
    latency figures. Both are the submitter's mistakes: ``invalid_request`` at once, naming the field."""
    bucket = CommonSettings().s3.bucket
    async with KafkaDoor() as door:
        long_id, neg_id = f"ref-long-{uuid.uuid4().hex[:8]}", f"ref-neg-{uuid.uuid4().hex[:8]}"
        await door.send(orjson.dumps({"request_id": long_id, "image_uri": f"s3://{bucket}/uploads/" + "k" * 5000}))
        await door.send(orjson.dumps({"request_id": neg_id, "image_b64": "aGk=", "submitted_at_ms": -5}))
        docs = await door.collect({long_id, neg_id})
    for rid, field in ((long_id, "image_uri"), (neg_id, "submitted_at_ms")):
        assert docs[rid].status == "error" and docs[rid].error.code is ErrorCode.INVALID_REQUEST, (rid, docs[rid].error)
        assert field in docs[rid].error.message


async def test_a_file_over_the_limit_is_refused_by_the_cli_before_anything_is_uploaded(pipeline, s3, tmp_path):
    limit = 720_000  # above inline_max_bytes (716,800): a file between them would go through S3
    big = os.urandom(limit + 40_000)
    sha = hashlib.sha256(big).hexdigest()
    path = tmp_path / "big.png"
    path.write_bytes(big)
    env = dict(os.environ, OCRSTREAM_LIMITS__MAX_IMAGE_BYTES=str(limit), COLUMNS="200")
    out = subprocess.run([sys.executable, "-m", "services.cli", "submit", "--no-wait", str(path)], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    said = " ".join(out.stderr.split())  # rich wraps long lines
    assert f"big.png: {len(big)} bytes, over the limit of {limit} bytes (OCRSTREAM_LIMITS__MAX_IMAGE_BYTES): " \
           "input_too_large, not submitted, nothing uploaded" in said, said
    assert out.stdout == ""
    s = CommonSettings()
    submitter = Submitter(s.model_copy(update={"limits": Limits(max_image_bytes=limit)}))
    await submitter.start()
    try:
        with pytest.raises(OcrError) as raised:
            await submitter.submit_bytes(big, filename="big.png")
    finally:
        await submitter.stop()
    assert raised.value.code is ErrorCode.INPUT_TOO_LARGE
    for key in (f"uploads/{sha}", image_object_key(sha)):
        assert not _exists(s3, s3.bucket, key), key
    listed = s3.list_objects_v2(Bucket=s3.bucket, Prefix="uploads/").get("Contents", [])
    assert not [o for o in listed if sha in o["Key"]]


def test_init_sets_the_upload_prefix_lifecycle_rule(s3, stack_env):
    subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
    rules = s3.get_bucket_lifecycle_configuration(Bucket=s3.bucket)["Rules"]
    ours = [r for r in rules if r["ID"] == upload_rule_id("uploads/")]
    assert len(ours) == 1, rules
    assert ours[0]["Filter"] == {"Prefix": "uploads/"} and ours[0]["Status"] == "Enabled"
    assert ours[0]["Expiration"] == {"Days": 1}
