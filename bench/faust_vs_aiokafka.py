"""faust-streaming vs the project's aiokafka StageRunner, on the local Kafka.

One run prints one comparison table. The script:

1. creates fresh topics ``bench-<hex>.in`` (pre-filled with N ~300-byte JSON records keyed by a
   sha256 hex key) and one output topic per contender (``bench-<hex>.out.aiokafka``,
   ``bench-<hex>.out.faust``), 4 partitions each;
2. runs each contender as its own subprocess (a passthrough stage: orjson parse, tiny transform,
   produce keyed the same, commit) and measures, from the parent:
   - startup: time from spawn to the first record processed (imports + group join), and the
     import share alone;
   - throughput: N / (time the out topic's end offsets reach N - time of first record);
   - peak RSS of the stage process (``VmHWM`` from /proc, read just before stopping it);
   - topics created by the stage (list before/after; only names starting with the stage's group /
     app id count, since the broker is shared and other sessions create topics concurrently);
   - output correctness: records on the out topic, distinct ids, duplicates, missing;
   - committed offsets of the stage's group on the in topic after a graceful stop;
   - Python warnings / errors on the stage's stderr (run with ``PYTHONWARNINGS=default``);
3. deletes the topics of this run (names starting with ``bench-<hex>``) and nothing else.

Usage::

    .venv/bin/python bench/faust_vs_aiokafka.py [--n 20000] [--timeout 180] [--only faust|aiokafka]

faust-streaming is *not* a project dependency; install it into the venv only for this bench:
``.venv/bin/pip install faust-streaming==0.11.3``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BOOTSTRAP = os.environ.get("OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092")
PARTITIONS = 4


def transform(doc: dict) -> dict:
    """The 'tiny transform' both contenders apply."""
    return {"id": doc["id"], "key": doc["key"], "n": len(doc["pad"]), "seen": True, "src_ts": doc["ts"]}


# ================================================================================================
# Worker side (runs in a subprocess)
# ================================================================================================

def _say(tag: str, **kw) -> None:
    """One line for the parent on stdout: TAG k=v ..."""
    print(tag, " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


def worker_aiokafka(in_topic: str, out_topic: str, group: str) -> None:
    import orjson

    from services.common.kafka import Outgoing, make_consumer, make_producer
    from services.common.runner import Handler, StageRunner
    from services.common.settings import KafkaSettings, TelemetrySettings
    from services.common.telemetry import Telemetry

    _say("IMPORTED", t=time.time())

    class Passthrough(Handler):
        first_done = False

        async def handle(self, records):
            out = []
            for r in records:
                doc = transform(orjson.loads(r.value))
                out.append(Outgoing(out_topic, r.key, orjson.dumps(doc)))
            if not self.first_done:
                self.first_done = True
                _say("FIRST", t=time.time())
            return out

        def poison(self, record, exc, attempts):
            return []

    async def main() -> None:
        cfg = KafkaSettings(bootstrap_servers=BOOTSTRAP)
        consumer = make_consumer(cfg, [in_topic], group, "bench-aiokafka")
        producer = make_producer(cfg, "bench-aiokafka")
        await consumer.start()
        await producer.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        # dedup's defaults: dedup_max_batch=64, dedup_max_wait_ms=5
        runner = StageRunner(
            stage="bench", consumer=consumer, producer=producer, handler=Passthrough(),
            telemetry=Telemetry("bench", TelemetrySettings()), max_batch=64, max_wait_ms=5,
        )
        try:
            await runner.run(stop)
        finally:
            await consumer.stop()
            await producer.stop()
        _say("STOPPED", t=time.time())

    asyncio.run(main())


def worker_faust(in_topic: str, out_topic: str, app_id: str) -> None:
    import faust
    import orjson

    _say("IMPORTED", t=time.time())

    app = faust.App(
        app_id,
        broker=f"kafka://{BOOTSTRAP}",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix=f"{app_id}-"),  # not ./{app_id}-data in the working directory
        web_enabled=False,
        topic_partitions=PARTITIONS,
        key_serializer="raw",
        value_serializer="raw",
    )
    src = app.topic(in_topic, key_type=bytes, value_type=bytes)
    dst = app.topic(out_topic, key_type=bytes, value_type=bytes)
    state = {"first": False}

    @app.agent(src)
    async def passthrough(stream):
        async for event in stream.events():
            doc = transform(orjson.loads(event.value))
            await dst.send(key=event.key, value=orjson.dumps(doc))
            if not state["first"]:
                state["first"] = True
                _say("FIRST", t=time.time())

    # programmatic worker: installs SIGTERM/SIGINT handlers, stops gracefully (commits on stop)
    from faust.worker import Worker

    worker = Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False)
    try:
        worker.execute_from_commandline()  # always ends in SystemExit (1 after a crash)
    finally:
        _say("STOPPED", t=time.time())


# ================================================================================================
# Parent side
# ================================================================================================

@dataclass
class Result:
    name: str
    ok: bool = False
    startup_s: float | None = None
    import_s: float | None = None
    run_s: float | None = None
    throughput: float | None = None
    peak_rss_mb: float | None = None
    new_topics: list[str] = field(default_factory=list)
    out_records: int = 0
    distinct: int = 0
    duplicates: int = 0
    missing: int = 0
    committed: int | None = None
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    exit_code: int | None = None
    note: str = ""


def _peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _admin():
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP, client_id="bench-admin")
    await admin.start()
    return admin


async def _list_topics() -> set[str]:
    admin = await _admin()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def _create_topics(names: list[str]) -> None:
    from aiokafka.admin import NewTopic

    admin = await _admin()
    try:
        await admin.create_topics([NewTopic(n, PARTITIONS, 1) for n in names])
    finally:
        await admin.close()
    # wait until metadata shows them
    for _ in range(50):
        if set(names) <= await _list_topics():
            return
        await asyncio.sleep(0.2)


async def _delete_topics(names: list[str]) -> None:
    if not names:
        return
    admin = await _admin()
    try:
        await admin.delete_topics(names)
    finally:
        await admin.close()


async def _committed(group: str, topic: str) -> int | None:
    admin = await _admin()
    try:
        offs = await admin.list_consumer_group_offsets(group)
        vals = [om.offset for tp, om in offs.items() if tp.topic == topic and om.offset >= 0]
        return sum(vals) if vals else 0
    except Exception:
        return None
    finally:
        await admin.close()


async def _prefill(topic: str, n: int) -> float:
    import orjson
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all", linger_ms=5, enable_idempotence=True)
    await producer.start()
    t0 = time.perf_counter()
    try:
        pad = "x" * 150
        futs = []
        for i in range(n):
            key = hashlib.sha256(f"bench-{i}".encode()).hexdigest()
            value = orjson.dumps({"id": i, "key": key, "ts": time.time(), "kind": "bench", "pad": pad})
            futs.append(await producer.send(topic, value, key=key.encode()))
            if len(futs) >= 2000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
    finally:
        await producer.stop()
    return time.perf_counter() - t0


async def _end_total(consumer, tps) -> int:
    ends = await consumer.end_offsets(tps)
    return sum(ends.values())


async def _read_all(topic: str, expected_total: int) -> list[bytes]:
    """Every value on ``topic`` from the beginning (no group)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, group_id=None, enable_auto_commit=False,
                         auto_offset_reset="earliest")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps)
        ends = await c.end_offsets(tps)
        await c.seek_to_beginning(*tps)
        values: list[bytes] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            positions = [await c.position(tp) for tp in tps]
            if all(pos >= ends[tp] for pos, tp in zip(positions, tps)):
                break
            got = await c.getmany(timeout_ms=500, max_records=5000)
            for recs in got.values():
                values.extend(r.value for r in recs)
        return values
    finally:
        await c.stop()


async def run_contender(name: str, kind: str, in_topic: str, out_topic: str, group: str, n: int,
                        timeout: float, all_before: set[str], precreate: list[str]) -> Result:
    import orjson
    from aiokafka import AIOKafkaConsumer, TopicPartition

    res = Result(name)
    if precreate:
        # created for the stage with aiokafka admin (CreateTopics v2+); counted as the stage's topics
        from aiokafka.admin import NewTopic

        admin = await _admin()
        try:
            await admin.create_topics([NewTopic(t, 1, 1) for t in precreate])
        finally:
            await admin.close()
        res.note = f"pre-created for it: {', '.join(precreate)}"
    env = dict(os.environ, PYTHONWARNINGS="default", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    errf = tempfile.NamedTemporaryFile("w+", suffix=f".{name}.stderr", delete=False)
    cmd = [sys.executable, str(Path(__file__).resolve()),
           "--worker", kind, "--in-topic", in_topic, "--out-topic", out_topic, "--group", group]
    watcher = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, group_id=None, enable_auto_commit=False)
    await watcher.start()
    out_tps = [TopicPartition(out_topic, p) for p in range(PARTITIONS)]

    t_spawn = time.time()
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=errf, env=env, cwd=str(ROOT))
    marks: dict[str, float] = {}

    async def read_stdout():
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").strip()
            m = re.search(r"(IMPORTED|FIRST|STOPPED) t=([\d.]+)", line)  # faust prefixes ANSI codes
            if m:
                marks[m.group(1)] = float(m.group(2))

    reader = asyncio.create_task(read_stdout())
    t_done = None
    peak = None
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                res.note += f" worker exited early rc={proc.returncode}"
                break
            peak = _peak_rss_mb(proc.pid) or peak
            if await _end_total(watcher, out_tps) >= n:
                t_done = time.time()
                break
            await asyncio.sleep(0.1)
        else:
            res.note += f" timeout after {timeout:.0f}s"
        # let the stage settle (a final commit interval) before stopping it gracefully
        if proc.returncode is None:
            await asyncio.sleep(3.5)
            peak = _peak_rss_mb(proc.pid) or peak
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 45)
            except asyncio.TimeoutError:
                res.note += " (did not stop in 45s after SIGTERM; killed)"
                proc.kill()
                await proc.wait()
    finally:
        await watcher.stop()
        try:
            await asyncio.wait_for(reader, 5)
        except asyncio.TimeoutError:
            reader.cancel()
    res.exit_code = proc.returncode
    res.peak_rss_mb = peak

    if "IMPORTED" in marks:
        res.import_s = marks["IMPORTED"] - t_spawn
    if "FIRST" in marks:
        res.startup_s = marks["FIRST"] - t_spawn
        if t_done:
            res.run_s = t_done - marks["FIRST"]
            res.throughput = n / res.run_s if res.run_s > 0 else None

    values = await _read_all(out_topic, n)
    ids = []
    for v in values:
        try:
            ids.append(orjson.loads(v)["id"])
        except Exception:
            pass
    res.out_records = len(values)
    res.distinct = len(set(ids))
    res.duplicates = len(ids) - len(set(ids))
    res.missing = len(set(range(n)) - set(ids))
    res.committed = await _committed(group, in_topic)

    after = await _list_topics()
    # The broker is shared (other sessions create topics concurrently), so only topics named after
    # this stage's group / app id are attributed to it (faust names its internal topics
    # "<app id>-..."); pre-created ones count too, since the stage needs them.
    res.new_topics = sorted({t for t in after - all_before if t.startswith(group)} | set(precreate))

    errf.seek(0)
    stderr = errf.read()
    errf.close()
    os.unlink(errf.name)
    res.warnings, res.errors = _scan_stderr(stderr)
    res.ok = (t_done is not None and res.missing == 0)
    return res


def _scan_stderr(text: str) -> tuple[list[str], list[str]]:
    warns: dict[str, int] = {}
    errs: dict[str, int] = {}
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if re.search(r"\b\w*Warning\b:", s):
            key = re.sub(r"^.*?/site-packages/", "", s)[:200]
            warns[key] = warns.get(key, 0) + 1
        elif re.search(r"Traceback|\bERROR\b|\bCRITICAL\b|Error:|Exception", s):
            key = re.sub(r"\[\d{4}-\d\d-\d\d [\d:,]+\]\s*", "", s)[:200]
            errs[key] = errs.get(key, 0) + 1
    return ([f"{k}  (x{v})" if v > 1 else k for k, v in warns.items()],
            [f"{k}  (x{v})" if v > 1 else k for k, v in errs.items()])


def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def print_table(results: list[Result], n: int, prefill_s: float) -> None:
    rows = [
        ("time to first record processed (s)", lambda r: _fmt(r.startup_s, ".2f")),
        ("  of which interpreter+imports (s)", lambda r: _fmt(r.import_s, ".2f")),
        (f"time to process {n} records (s)", lambda r: _fmt(r.run_s, ".2f")),
        ("throughput (msgs/s)", lambda r: _fmt(r.throughput, ",.0f")),
        ("peak RSS of stage process (MiB)", lambda r: _fmt(r.peak_rss_mb, ".1f")),
        ("extra topics created by the stage", lambda r: str(len(r.new_topics))),
        ("records on out topic", lambda r: str(r.out_records)),
        ("distinct ids / duplicates / missing", lambda r: f"{r.distinct} / {r.duplicates} / {r.missing}"),
        ("output == N, no loss", lambda r: "yes" if r.missing == 0 and r.out_records >= n else "NO"),
        ("committed offsets after stop (sum)", lambda r: _fmt(r.committed)),
        ("warnings / error lines on stderr", lambda r: f"{len(r.warnings)} / {len(r.errors)}"),
        ("exit code after SIGTERM", lambda r: _fmt(r.exit_code)),
    ]
    w0 = max(len(r[0]) for r in rows) + 2
    w = 18
    print()
    print(f"N={n} records (~300 B JSON, sha256 keys), {PARTITIONS} partitions, broker {BOOTSTRAP}; "
          f"prefill took {prefill_s:.2f}s")
    print("-" * (w0 + w * len(results)))
    print("".ljust(w0) + "".join(r.name.rjust(w) for r in results))
    print("-" * (w0 + w * len(results)))
    for label, f in rows:
        print(label.ljust(w0) + "".join(f(r).rjust(w) for r in results))
    print("-" * (w0 + w * len(results)))
    for r in results:
        if r.note:
            print(f"[{r.name}] note: {r.note}")
        if r.new_topics:
            print(f"[{r.name}] topics created: {', '.join(r.new_topics)}")
        for line in r.warnings:
            print(f"[{r.name}] warning: {line}")
        for line in r.errors[:15]:
            print(f"[{r.name}] error: {line}")
        if len(r.errors) > 15:
            print(f"[{r.name}] ... {len(r.errors) - 15} more distinct error lines")


async def parent(args) -> int:
    prefix = f"bench-{uuid.uuid4().hex[:10]}"
    in_topic = f"{prefix}.in"
    # (column, worker kind, pre-create faust's leader topic?)
    contenders = [("aiokafka", "aiokafka", False), ("faust", "faust", False), ("faust+leader", "faust", True)]
    if args.only:
        contenders = [c for c in contenders if c[1] == args.only]
    outs = {c[0]: f"{prefix}.out.{c[0].replace('+', '-')}" for c in contenders}
    own = [in_topic, *outs.values()]
    print(f"bench prefix {prefix}")
    before = await _list_topics()
    results: list[Result] = []
    try:
        await _create_topics(own)
        prefill_s = await _prefill(in_topic, args.n)
        for col, kind, leader in contenders:
            group = f"{prefix}-{col.replace('+', '-')}"  # consumer group (aiokafka) / app id (faust)
            all_before = await _list_topics()
            # faust 0.11.3 creates its leader topic with CreateTopicsRequest v1, which Kafka >= 4.0
            # rejects (KIP-896) by closing the connection; faust skips creation when it exists.
            precreate = [f"{group}-__assignor-__leader"] if leader else []
            print(f"running {col} ...", flush=True)
            res = await run_contender(col, kind, in_topic, outs[col], group, args.n, args.timeout,
                                      all_before, precreate)
            results.append(res)
        print_table(results, args.n, prefill_s)
    finally:
        leftovers = (await _list_topics()) - before
        # only ever delete this run's own topics: the broker is shared
        to_delete = sorted(t for t in leftovers if t.startswith(prefix + ".") or t.startswith(prefix + "-"))
        await _delete_topics(to_delete)
        print(f"deleted topics: {', '.join(to_delete) or '-'}")
    return 0 if all(r.ok for r in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="records to pre-fill and process")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per contender")
    ap.add_argument("--only", choices=["aiokafka", "faust"])
    ap.add_argument("--worker", choices=["aiokafka", "faust"], help=argparse.SUPPRESS)
    ap.add_argument("--in-topic", help=argparse.SUPPRESS)
    ap.add_argument("--out-topic", help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "aiokafka":
        worker_aiokafka(args.in_topic, args.out_topic, args.group)
        return 0
    if args.worker == "faust":
        worker_faust(args.in_topic, args.out_topic, args.group)
        return 0
    return asyncio.run(parent(args))


if __name__ == "__main__":
    sys.exit(main())
