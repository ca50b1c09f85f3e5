"""``ocrstream report``: where the time goes, from the completed requests in MariaDB.

Reads ``requests.timings_json`` of the requests completed since a point in time, prints each
stage's p50/p95/p99 and its share of the total time (a rich table) and, optionally, writes a
PNG: a stacked bar of the stage shares and a histogram of the submit-to-completion latency.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import orjson
from rich.table import Table

from services.common.wording import plural

# Stage timings in pipeline order (keys of ``ResultDocument.timings_ms``), ``total`` apart.
STAGES = (
    "queue_ingest", "ingest", "queue_dedup", "dedup", "queue_infer", "fetch", "decode", "preprocess",
    "engine_wait", "inference", "postprocess", "queue_sink", "write",
)
_UNITS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}


def parse_since(value: str, now_ms: int | None = None) -> int:
    """Start of the report window in epoch ms.

    Args:
        value: A duration back from now (``90s``, ``15m``, ``1h``, ``2d``, ``1w``; one longer
            than the time since 1970 means everything) or an ISO 8601 time
            (``2024-05-01T12:00:00``, naive = UTC).
        now_ms: "Now" in epoch ms (default: the clock).

    Raises:
        ValueError: neither a duration nor an ISO time.
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", value)
    if m:
        return max(0, now_ms - int(float(m.group(1)) * _UNITS[m.group(2)]))  # at most: everything
    try:
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since: {value!r} is neither a duration like 1h/30m/2d nor an ISO time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


@dataclass
class StageStats:
    """Percentiles (ms) of one timing over the requests that have it, and its share of all time."""

    name: str
    count: int
    p50: float
    p95: float
    p99: float
    mean: float
    share: float  # sum of this stage over the sum of ``total``, 0..1


@dataclass
class Report:
    """What ``ocrstream report`` shows."""

    since_ms: int
    requests: int
    ok: int
    cache_hits: int
    totals: list[float] = field(default_factory=list)
    stages: list[StageStats] = field(default_factory=list)
    total: StageStats | None = None

    @property
    def unaccounted_share(self) -> float:
        """Share of the total time no stage timing explains (hand-offs between stages)."""
        return max(0.0, 1.0 - sum(s.share for s in self.stages))


def summarize(rows: list[dict], since_ms: int = 0) -> Report:
    """Build the report from ``requests`` rows (``timings_json``, ``status``, ``cache_hit``)."""
    timings: list[dict[str, float]] = []
    ok = hits = 0
    for r in rows:
        raw = r.get("timings_json")
        t = orjson.loads(raw) if isinstance(raw, (str, bytes)) else (raw or {})
        if not t.get("total"):
            continue
        timings.append({k: float(v) for k, v in t.items() if isinstance(v, (int, float))})
        ok += r.get("status") == "ok"
        hits += bool(r.get("cache_hit"))
    rep = Report(since_ms=since_ms, requests=len(timings), ok=ok, cache_hits=hits)
    if not timings:
        return rep
    rep.totals = [t["total"] for t in timings]
    all_time = sum(rep.totals)

    def stats(name: str, values: list[float]) -> StageStats:
        a = np.asarray(values, dtype=float)
        p50, p95, p99 = np.percentile(a, [50, 95, 99])
        return StageStats(name, len(a), float(p50), float(p95), float(p99), float(a.mean()),
                          float(a.sum() / all_time) if all_time > 0 else 0.0)

    for name in STAGES:
        values = [t[name] for t in timings if name in t]
        if values:
            rep.stages.append(stats(name, values))
    rep.total = stats("total", rep.totals)
    return rep


def render_table(rep: Report) -> Table:
    """The report as a rich table: one row per stage, then ``unaccounted`` and ``total``."""
    since = datetime.fromtimestamp(rep.since_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    table = Table(title=f"{plural(rep.requests, 'request')} completed since {since} "
                        f"({rep.ok} ok, {plural(rep.cache_hits, 'cache hit')}); times in ms")
    for col in ("stage", "n", "p50", "p95", "p99", "mean", "share"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in rep.stages:
        table.add_row(s.name, str(s.count), f"{s.p50:.1f}", f"{s.p95:.1f}", f"{s.p99:.1f}", f"{s.mean:.1f}",
                      f"{100 * s.share:.1f}%")
    if rep.total:
        table.add_row("unaccounted", "", "", "", "", "", f"{100 * rep.unaccounted_share:.1f}%", style="dim")
        t = rep.total
        table.add_row("total", str(t.count), f"{t.p50:.1f}", f"{t.p95:.1f}", f"{t.p99:.1f}", f"{t.mean:.1f}",
                      "100.0%", style="bold")
    return table


def write_png(rep: Report, path: Path) -> Path:
    """Stacked bar of stage shares and a histogram of total latency, as a PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    left = 0.0
    cmap = plt.get_cmap("tab20")
    parts = [(s.name, s.share) for s in rep.stages] + [("unaccounted", rep.unaccounted_share)]
    for i, (name, share) in enumerate(parts):
        ax1.barh(["share of total"], [100 * share], left=[left], color=cmap(i % 20), label=name)
        left += 100 * share
    ax1.set_xlim(0, max(100.0, left))
    ax1.set_xlabel("% of submit-to-completion time")
    ax1.set_title("Where the time goes")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4)
    if rep.totals:
        ax2.hist(rep.totals, bins=min(50, max(5, len(rep.totals) // 4)), color="tab:blue")
        if rep.total:
            for q, v in (("p50", rep.total.p50), ("p95", rep.total.p95), ("p99", rep.total.p99)):
                ax2.axvline(v, linestyle="--", color="gray")
                ax2.text(v, ax2.get_ylim()[1] * 0.95, q, rotation=90, fontsize=7, va="top")
    ax2.set_xlabel("total latency (ms)")
    ax2.set_ylabel("requests")
    ax2.set_title(f"Latency of {plural(rep.requests, 'request')}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def load_rows(db, since_ms: int, source: str | None = None) -> list[dict]:
    """Completed requests since ``since_ms`` (optionally of one ``source``) from MariaDB."""
    sql = "SELECT timings_json, status, cache_hit FROM requests WHERE completed_at_ms >= %s"
    args: list = [since_ms]
    if source:
        sql += " AND source = %s"
        args.append(source)
    return await db.query(sql, *args)
