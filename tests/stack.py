"""Test helpers that run the real pipeline: stage processes against the local stack.

Each test session gets its own namespace (topic names, consumer groups, Redis key prefix),
so tests never see a running demo's messages and leave the defaults untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from schemas.events import ResultDocument
from schemas.topics import Topics
from services.cli.client import Submitter
from services.common.results.completions import CompletionWatcher
from services.common.settings import CommonSettings

REPO = Path(__file__).resolve().parent.parent
STAGES = ("ingest", "dedup", "infer", "sink")
API = "api"  # the HTTP front door: ``Pipeline.start(API)``
JOBS = "jobs"  # the jobs stage: ``Pipeline.start(JOBS)`` (tests of jobs start it; docs/jobs.md)
WEBHOOKS = "webhooks"  # the webhooks stage: started with the session's door (tests/integration/conftest.py)


#: First port :func:`free_port` hands out, and the ports each pytest-xdist worker (gw0, gw1, ...) has:
#: below Linux's ephemeral range (32768-60999 by default), so no outgoing connection takes one
#: between the call and the stage's bind, and a block per worker, so two workers never hand out the
#: same one (a port the kernel picked, closed and handed over could be both: CI saw a stage fail
#: with "address already in use").
PORT_BASE, PORTS_PER_WORKER = 20_000, 1_000
_next_port = [0]


def free_port() -> int:
    """A TCP port no one listens on, from this process's block (:data:`PORT_BASE`), for a stage or
    a loopback server to bind next (a port found taken is skipped).

    Raises:
        OSError: every port of the block is taken.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    block = PORT_BASE + PORTS_PER_WORKER * (int(worker[2:]) if worker[2:].isdigit() else 0)
    for _ in range(PORTS_PER_WORKER):
        port = block + _next_port[0] % PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {block}-{block + PORTS_PER_WORKER - 1}")


#: What every stack test's stages get on top of their namespace (not the benchmarks: they measure
#: the defaults). A loaded 2-core CI machine can hold a Redis answer past the 100 ms default budget:
#: a cache hit would then read as a miss, and three in a row open the breaker for a second. A test
#: of the budget itself sets its own (tests/fault/test_outages.py).
TEST_ENV = {"OCRSTREAM_REDIS__TIMEOUT_MS": "2000"}


def namespace_env(tag: str | None = None, partitions: int = 2) -> dict[str, str]:
    """Environment variables isolating one test namespace."""
    ns = tag or f"t{uuid.uuid4().hex[:8]}"
    env = {
        "OCRSTREAM_KAFKA__PARTITIONS": str(partitions),
        "OCRSTREAM_REDIS__KEY_PREFIX": ns,
        # a bucket per namespace: dedup's S3 tier answers from stored result documents, so another
        # namespace's (or an earlier run's) results of the same image must not be found
        "OCRSTREAM_S3__BUCKET": ns,
        "OCRSTREAM_INGEST_GROUP_ID": f"{ns}-ingest",
        "OCRSTREAM_DEDUP_GROUP_ID": f"{ns}-dedup",
        "OCRSTREAM_INFER_GROUP_ID": f"{ns}-infer",
        "OCRSTREAM_SINK_GROUP_ID": f"{ns}-sink",
        "OCRSTREAM_JOBS_GROUP_ID": f"{ns}-jobs",
        "OCRSTREAM_WEBHOOK_GROUP_ID": f"{ns}-webhooks",  # also owns the namespace's webhook_deliveries rows
        "OCRSTREAM_TELEMETRY__LOG_LEVEL": "INFO",
    }
    for name in Topics.model_fields:
        env[f"OCRSTREAM_TOPICS__{name.upper()}"] = f"{ns}.ocr.{name}"
    return env


#: Env var that makes a missing stack (or helm) fail the run instead of skipping; scripts/test.sh sets it.
STRICT_ENV = "OCRSTREAM_TEST_STRICT"
UP_HINT = "run `bash deploy/local/up.sh`"


def stack_addresses() -> list[tuple[str, str, int]]:
    """``(name, host, port)`` of Kafka (first bootstrap server), Redis, MariaDB and S3 from the settings.

    They come from the ``OCRSTREAM_*`` env vars like the stages' own (defaults: the local stack on
    127.0.0.1 ports 9092, 6379, 3306, 9000), so a test run pointed elsewhere checks what it will use.
    Redis over a unix socket and S3 without an endpoint (AWS) are not checked.
    """
    cfg = CommonSettings()
    host, _, port = cfg.kafka.bootstrap_servers.split(",")[0].strip().rpartition(":")
    out = [("kafka", host or "127.0.0.1", int(port or 9092))]
    r = urlsplit(cfg.redis.url)
    if r.scheme != "unix":
        out.append(("redis", r.hostname or "127.0.0.1", r.port or 6379))
    out.append(("mariadb", cfg.mysql.host, cfg.mysql.port))
    if cfg.s3.endpoint_url:
        s3 = urlsplit(cfg.s3.endpoint_url)
        out.append(("s3", s3.hostname or "127.0.0.1", s3.port or (443 if s3.scheme == "https" else 80)))
    return out


def stack_reachable() -> str | None:
    """None if Kafka, Redis, MariaDB and S3 accept a TCP connection (1 s each), else what is missing.

    Returns:
        e.g. ``"kafka 127.0.0.1:9092, redis 127.0.0.1:6379"``, or None when all answer.
    """
    missing = []
    for name, host, port in stack_addresses():
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) != 0:
                missing.append(f"{name} {host}:{port}")
    return ", ".join(missing) or None


def strict_run() -> bool:
    """True in CI (``CI`` set, not ``0``/``false``) or when scripts/test.sh set ``OCRSTREAM_TEST_STRICT=1``:
    there a missing stack (or helm) fails the tests that need it instead of skipping them."""
    def on(name: str) -> bool:
        return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
    return on(STRICT_ENV) or on("CI")


_stack_problem: list[str | None] = []


def require_stack() -> None:
    """Skip the calling test (or fixture) when the local stack is not up; fail it instead in CI.

    The check runs once per session (its answer is kept). The message is one line, e.g.
    ``the local stack is not up (kafka 127.0.0.1:9092): run `bash deploy/local/up.sh```.

    Raises:
        pytest.skip.Exception: the stack is missing and :func:`strict_run` is false.
        pytest.fail.Exception: the stack is missing and :func:`strict_run` is true.
    """
    import pytest

    if not _stack_problem:
        _stack_problem.append(stack_reachable())
    missing = _stack_problem[0]
    if missing is None:
        return
    if strict_run():
        pytest.fail(f"the local stack is not up ({missing}) and this run requires it "
                    f"({STRICT_ENV}=1 or CI): {UP_HINT}", pytrace=False)
    pytest.skip(f"the local stack is not up ({missing}): {UP_HINT}")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"([^{ ]+)(\{(.*)\})? ([0-9.eE+-]+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
    return total


@dataclass
class Stage:
    """One running stage process."""

    name: str
    port: int
    log: Path
    proc: subprocess.Popen | None = None


@dataclass
class Pipeline:
    """The four stages as real processes, plus helpers to submit and wait."""

    env: dict[str, str]
    logdir: Path
    stages: dict[str, list[Stage]] = field(default_factory=dict)

    def settings(self) -> CommonSettings:
        """Settings as the stages see them."""
        return CommonSettings()

    def start(self, name: str, extra_env: dict[str, str] | None = None, wait_ready: bool = True) -> Stage:
        """Start one more process of stage ``name`` (or of the HTTP door, :data:`API`, on ``Stage.port``)."""
        port = free_port()
        idx = len(self.stages.get(name, []))
        st = Stage(name, port, self.logdir / f"{name}-{idx}.log")
        env = {**os.environ, **self.env, **(extra_env or {}), "OCRSTREAM_TELEMETRY__METRICS_PORT": str(port),
               "PYTHONUNBUFFERED": "1"}
        if name == API:  # the HTTP door serves /readyz and /metrics on its own port
            env["OCRSTREAM_HTTP_PORT"] = str(port)
        with open(st.log, "ab") as logf:
            st.proc = subprocess.Popen([sys.executable, "-m", f"services.{name}"], cwd=REPO, env=env,
                                       stdout=logf, stderr=subprocess.STDOUT)
        self.stages.setdefault(name, []).append(st)
        if wait_ready:
            self.wait_ready(st)
        return st

    def wait_ready(self, st: Stage, timeout: float = 180) -> None:
        """Block until ``/readyz`` of ``st`` answers 200."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if st.proc.poll() is not None:
                raise RuntimeError(f"{st.name} exited with {st.proc.returncode}:\n{st.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{st.name} not ready after {timeout}s:\n{st.log.read_text()[-3000:]}")

    def start_all(self) -> None:
        """Start one process per stage and wait for all of them."""
        for name in STAGES:
            self.start(name, wait_ready=False)
        for name in STAGES:
            self.wait_ready(self.stages[name][-1])

    def metrics(self, name: str) -> str:
        """Concatenated ``/metrics`` text of every live process of stage ``name``."""
        out = []
        for st in self.stages.get(name, []):
            if st.proc and st.proc.poll() is None:
                with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/metrics", timeout=5) as r:
                    out.append(r.read().decode())
        return "\n".join(out)

    def engine_calls(self) -> float:
        """Images the infer processes have run through the engine (live processes only)."""
        return metric_value(self.metrics("infer"), "ocrstream_engine_images_total")

    def stop(self, st: Stage, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal a stage process and wait for it to exit; returns its exit code."""
        if st.proc.poll() is None:
            st.proc.send_signal(sig)
        return st.proc.wait(timeout)

    def stop_all(self) -> None:
        """SIGTERM every stage process (SIGKILL after 30 s)."""
        for sts in self.stages.values():
            for st in sts:
                if st.proc and st.proc.poll() is None:
                    st.proc.send_signal(signal.SIGTERM)
        for sts in self.stages.values():
            for st in sts:
                if st.proc:
                    try:
                        st.proc.wait(30)
                    except subprocess.TimeoutExpired:
                        st.proc.kill()

    async def run(self, items: list[tuple[bytes, str]], timeout: float = 300, source: str = "test",
                  task: str = "ocr", task_params=None, job_id: str | None = None) -> list[ResultDocument]:
        """Submit ``(bytes, filename)`` items through ``ocr.submit`` (with ``task`` and its
        ``task_params``, a :class:`schemas.tasks.TaskParams`, in job ``job_id`` when given) and
        wait for every completion.

        Returns:
            The result documents, in submission order.
        """
        s = CommonSettings()
        watcher = CompletionWatcher(s)
        submitter = Submitter(s)
        await watcher.start()
        await submitter.start()
        try:
            ids = await submitter.submit_many(items, source=source, task=task, task_params=task_params, job_id=job_id)
        finally:
            await submitter.stop()
        done: dict[str, ResultDocument] = {}
        try:
            async def collect():
                async for ev in watcher.completions(set(ids)):
                    done[ev.request_id] = ev.result

            await asyncio.wait_for(collect(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"only {len(done)}/{len(ids)} completed in {timeout}s; logs in {self.logdir}")
        finally:
            await watcher.stop()
        return [done[i] for i in ids]


def db_rows(sql: str, *args) -> list[dict]:
    """Rows of one SQL statement on the MariaDB the current environment points at (autocommit)."""
    import pymysql

    c = CommonSettings().mysql
    conn = pymysql.connect(host=c.host, port=c.port, user=c.user, password=c.password.get_secret_value(),
                           database=c.database, autocommit=True, cursorclass=pymysql.cursors.DictCursor)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())
    finally:
        conn.close()


@contextlib.contextmanager
def env_applied(env: dict[str, str]):
    """This process's environment updated with ``env`` for the duration; restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The CPU engine's detector limit of the namespaced (plumbing) pipelines: RapidOCR upscales an
#: image's short side to this many pixels before detection, so a one-line test image (~110 px high)
#: costs ~40x its pixels at the default 736 px. At 320 px the same 40 generated images (one to three
#: printed lines each) were read exactly as at 736 px, at 0.19x the CPU (8.4 s against 43.6 s on
#: this 2-core machine). The session pipeline, which runs the accuracy tests (the samples' CER, the
#: generated pages' exact lines, ../shared/cases), keeps the default.
PLUMBING_ENGINE = {"OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": "320"}


@contextlib.contextmanager
def namespaced_pipeline(logdir: Path, extra_env: dict[str, str] | None = None, partitions: int = 4,
                        for_tests: bool = True):
    """A running pipeline in a fresh namespace (topics created), with this process's environment
    pointed at it for the duration; restored afterwards.

    Args:
        logdir: Folder for the stage logs (created).
        extra_env: Settings for these stages on top of the namespace, :data:`PLUMBING_ENGINE` and
            :data:`TEST_ENV` (e.g. shorter timeouts).
        partitions: Partitions per topic.
        for_tests: False for a benchmark: no :data:`TEST_ENV`, the product's budgets.
    """
    env = {**namespace_env(partitions=partitions), **PLUMBING_ENGINE, **(TEST_ENV if for_tests else {}),
           **(extra_env or {})}
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        logdir.mkdir(parents=True, exist_ok=True)
        p = Pipeline(env=env, logdir=logdir)
        try:
            p.start_all()
            yield p
        finally:
            p.stop_all()


class JsonStubHandler(BaseHTTPRequestHandler):
    """Base of the loopback stub servers the tests start (an OpenAI-compatible model server, ...):
    quiet, and ``_send(code, obj)`` answers ``obj`` as JSON with a Content-Length."""

    def log_message(self, *args):
        pass

    def _send(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def is_red_image(body: bytes) -> bool:
    """Whether a chat-completions request body carries a red image (the tests' poison image)."""
    import base64
    import io

    from PIL import Image

    url = json.loads(body)["messages"][-1]["content"][0]["image_url"]["url"]
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    r, g, b = img.getpixel((5, 5))
    return r > 200 and g < 60 and b < 60


class LoopbackOcrServer:
    """An OpenAI-compatible OCR server on 127.0.0.1:``port`` (a thread of this process) that answers
    every chat completion with ``answer`` as one text-spotting line, and every GET (``/health``,
    ``/v1/models``) with the model list. :meth:`stop` closes the port, :meth:`start` opens it again.

    ``dies_on(body)``: for a chat-completion body it returns True on, the server dies as a model
    server process would: the connection is dropped unanswered and the port closed at once, and
    it starts again on the same port ``down_s`` seconds later. ``posts`` counts the chat
    completions answered (the warm-up included), ``crashes`` the deaths.

    ``hangs_on(body)``: for a body it returns True on, the request is held unanswered (a model
    server wedged on it) until :meth:`stop`; ``holding`` is set and ``held`` counts them.

    ``holds_on(body)``: for a body it returns True on, the request is held until :meth:`let_go`,
    then answered as usual (a page the model takes long to read); ``holding`` is set meanwhile.

    ``delay_s``: every other chat completion is answered after this many seconds (requests are
    served concurrently, one thread each), so pages stay in flight as on a busy GPU;
    ``in_flight`` counts the chat completions being served now, ``most_in_flight`` the most at once.

    ``replies``: instruction text -> ``(answer, finish_reason)``, a canned answer per task's prompt
    (as it is, no spotting boxes added). ``received``: every chat completion's ``prompt`` (the
    instruction text), ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` and
    ``repetition_penalty``, in arrival order.
    """

    def __init__(self, answer: str, dies_on: Callable[[bytes], bool] | None = None, down_s: float = 1.5,
                 hangs_on: Callable[[bytes], bool] | None = None, holds_on: Callable[[bytes], bool] | None = None,
                 delay_s: float = 0.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.answer = answer
        self.dies_on = dies_on
        self.hangs_on = hangs_on
        self.holds_on = holds_on
        self.delay_s = delay_s
        self.in_flight = 0
        self.most_in_flight = 0
        self.let_go_event = threading.Event()
        self.down_s = down_s
        self.posts = 0
        self.crashes = 0
        self.held = 0
        self.holding = threading.Event()
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None
        self.replies: dict[str, tuple[str, str]] = {}
        self.received: list[dict] = []

    def start(self) -> None:
        srv = self

        class Handler(JsonStubHandler):
            def do_GET(self):
                self._send(200, {"data": [{"id": "tencent/HunyuanOCR"}]})

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with srv.lock:
                    srv.in_flight += 1
                    srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
                try:
                    self._post(body)
                finally:
                    with srv.lock:
                        srv.in_flight -= 1

            def _post(self, body: bytes):
                if srv.dies_on is not None and srv.dies_on(body):
                    srv._die()
                    self.close_connection = True
                    self.connection.close()  # no answer: the process died under it
                    return
                if srv.hangs_on is not None and srv.hangs_on(body):
                    with srv.lock:
                        srv.held += 1
                    srv.holding.set()
                    srv.released.wait(600)  # the client is killed meanwhile
                    return
                if srv.holds_on is not None and srv.holds_on(body):
                    srv.holding.set()
                    srv.let_go_event.wait(600)
                elif srv.delay_s:
                    time.sleep(srv.delay_s)
                req = json.loads(body)
                try:
                    prompt = req["messages"][-1]["content"][-1]["text"]
                except (KeyError, IndexError, TypeError):
                    prompt = None
                with srv.lock:
                    srv.posts += 1
                    srv.received.append({"prompt": prompt, **{k: req.get(k) for k in (
                        "temperature", "top_p", "top_k", "max_tokens", "repetition_penalty")}})
                content, finish = srv.replies.get(prompt, (f"{srv.answer}(100,100),(900,400)", "stop"))
                self._send(200, {"choices": [{"message": {"content": content}, "finish_reason": finish}]})

        httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        httpd.daemon_threads = True
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def _die(self) -> None:
        with self.lock:
            self.crashes += 1
            httpd, self.httpd = self.httpd, None
        if httpd is None:
            return
        httpd.socket.close()  # refused from now on
        threading.Thread(target=httpd.shutdown, daemon=True).start()
        threading.Timer(self.down_s, self.start).start()

    def let_go(self) -> None:
        """Answer the requests ``holds_on`` held (and every later one at once)."""
        self.let_go_event.set()

    def stop(self) -> None:
        """Close the port (held requests are let go)."""
        self.released.set()
        self.let_go_event.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
