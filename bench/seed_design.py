"""The seed design's HTTP side (Celery + Redis + FastAPI OCR queue), rebuilt as a baseline for
``bench/http_bench.py``; run as its own process: ``python -m bench.seed_design --port P --prefix NS``.

What is faithful to the seed:

* ``POST /ocr`` takes a FastAPI ``UploadFile`` (``multipart/form-data``, field ``file``, as the
  seed's web form sends it), reads it whole, hashes it (SHA-256), and does one Redis ``GET`` of
  the cache entry for that hash in the upload handler: a hit is answered ``200`` with the cached
  JSON; a miss enqueues a task and answers ``202`` with its id.
* Enqueueing is what ``task.delay(image_b64)`` does with Celery's Redis broker: one ``LPUSH`` of a
  kombu message (Celery message protocol 2: ``headers`` with the task name and id, ``properties``
  with ``body_encoding: base64``, the JSON ``[args, kwargs, embed]`` body base64-encoded, the image
  base64-encoded inside it since the JSON serializer cannot carry bytes) onto the queue list
  (``<prefix>:celery`` here; Celery's default queue key is ``celery``).
* Results live where Celery's Redis result backend keeps them: ``celery-task-meta-<id>`` keys
  (JSON ``{"status", "result", "traceback", "children", "date_done", "task_id"}``), read by
  ``GET /result/{task_id}`` (one ``GET``, what ``AsyncResult(id).state``/``.result`` do), which
  clients poll every few seconds (every 0.2 s in the measured seed clients).

What is chosen or left out:

* No Celery and no worker: this is a bench of the HTTP side. :func:`finish` writes what a worker
  would on success (the meta key and the cache entry), so the bench can make an image cached.
* A task row (``celery-task-meta-<id>`` with status ``PENDING``) is written at upload, so an
  unknown id is ``404`` (Celery itself writes nothing until the task runs and calls unknown ids
  ``PENDING``); one ``SET`` more on the 202 path.
* The seed's best case where it had a choice: ``redis.asyncio`` (no blocking calls on the event
  loop), the cached JSON passed through as bytes (no decode/encode), uvicorn with uvloop and
  httptools, no access log, one process: the same server settings as the ocrstream door. No
  Redis result-backend pub/sub subscription (that happens in the client calling ``.get()``).
* All keys carry ``--prefix`` (the bench's namespace); :func:`cleanup` deletes them.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import uuid

import redis.asyncio as aioredis
from fastapi import FastAPI, File, Response, UploadFile

#: Celery's default ``result_expires`` (1 day), s: the meta keys' TTL.
RESULT_EXPIRES_S = 86_400
TASK_NAME = "seed.ocr"


def _meta(task_id: str, status: str, result: object = None) -> bytes:
    """A Celery Redis result-backend value (``celery/backends/base.py``, ``_get_result_meta``)."""
    return json.dumps({"status": status, "result": result, "traceback": None, "children": [],
                       "date_done": None, "task_id": task_id}).encode()


def _message(task_id: str, image: bytes) -> bytes:
    """The kombu message Celery's ``apply_async`` pushes (task message protocol 2, JSON serializer)."""
    b64 = base64.b64encode(image).decode()
    body = json.dumps([[b64], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    return json.dumps({
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": TASK_NAME, "id": task_id, "shadow": None, "eta": None, "expires": None,
                    "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
                    "root_id": task_id, "parent_id": None, "argsrepr": f"('{b64[:40]}...',)", "kwargsrepr": "{}",
                    "origin": "gen1@seed", "ignore_result": False},
        "properties": {"correlation_id": task_id, "reply_to": str(uuid.uuid4()), "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": "celery"}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    }).encode()


def create_app(redis_url: str, prefix: str) -> FastAPI:
    """The seed's two routes on one Redis client; keys under ``prefix``."""
    app = FastAPI(title="seed design (bench baseline)")
    r = aioredis.from_url(redis_url)

    @app.post("/ocr")
    async def ocr(file: UploadFile = File(...)) -> Response:
        data = await file.read()
        sha = hashlib.sha256(data).hexdigest()
        cached = await r.get(f"{prefix}:ocr-cache:{sha}")
        if cached is not None:
            return Response(cached, status_code=200, media_type="application/json")
        task_id = str(uuid.uuid4())
        await r.lpush(f"{prefix}:celery", _message(task_id, data))
        await r.set(f"{prefix}:celery-task-meta-{task_id}", _meta(task_id, "PENDING"), ex=RESULT_EXPIRES_S)
        return Response(json.dumps({"task_id": task_id, "status": "PENDING"}), status_code=202,
                        media_type="application/json")

    @app.get("/result/{task_id}")
    async def result(task_id: str) -> Response:
        meta = await r.get(f"{prefix}:celery-task-meta-{task_id}")
        if meta is None:
            return Response(json.dumps({"detail": "unknown task"}), status_code=404, media_type="application/json")
        return Response(meta, media_type="application/json")

    return app


def finish(r, prefix: str, task_id: str, image: bytes, result: dict) -> None:
    """Write what the seed's worker writes on success: the task's meta (``SUCCESS``) and the
    cache entry of the image's SHA-256. ``r``: a synchronous ``redis.Redis``."""
    sha = hashlib.sha256(image).hexdigest()
    r.set(f"{prefix}:celery-task-meta-{task_id}", _meta(task_id, "SUCCESS", result), ex=RESULT_EXPIRES_S)
    r.set(f"{prefix}:ocr-cache:{sha}", json.dumps({"task_id": task_id, "status": "SUCCESS", "result": result}))


def cleanup(r, prefix: str) -> int:
    """Delete every key under ``prefix`` (``SCAN``, never ``KEYS``); returns how many."""
    n = 0
    for key in r.scan_iter(match=f"{prefix}:*", count=1000):
        n += r.delete(key)
    return n


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefix", required=True, help="Redis key prefix (the bench's namespace)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    config = uvicorn.Config(create_app(args.redis_url, args.prefix), host="127.0.0.1", port=args.port,
                            loop="uvloop", http="httptools", access_log=False, log_config=None)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
