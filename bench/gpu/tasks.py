"""The per-task part of the GPU check (bench/gpu/throughput.py ``--tasks``): which tasks, with which
parameters, and the report of pages/s and output tokens/s per task and batch size.

Pure logic, no GPU: the tasks are those of the registry (:data:`schemas.tasks.TASKS`), their
parameters fixed so runs compare (``extract``: four invoice fields, ``translate``: into English),
and :func:`format_report` turns measured :class:`TaskRun` rows into the table the script prints.

Pages/s counts every page the engine answered, including ``unparsable_output`` (a randomly
initialised model writes no JSON, so ``extract`` and any parser would refuse its answers; the
engine's work is the same). Output tokens/s is the engine's generated tokens
(:attr:`services.infer.engines.vllm_engine.VllmEngine.output_tokens`) over the same wall time.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.tasks import TASKS, TaskParams

EXTRACT_FIELDS = ("invoice number", "date", "total", "seller")
"""The fields ``extract`` asks for in the GPU check."""

TARGET_LANG = "en"
"""The language ``translate`` asks for in the GPU check."""


def parse_tasks(value: str) -> list[str]:
    """``--tasks``: ``all`` (every task of the registry, in its order) or a comma-separated list.

    Raises:
        ValueError: an empty list, or a name not in :data:`schemas.tasks.TASKS` (the message
            lists the known ones).
    """
    if value.strip() == "all":
        return list(TASKS)
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError("--tasks: no task given (use all or e.g. ocr,doc_parse)")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; known: all, {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def task_params(task: str) -> TaskParams | None:
    """The parameters the check sends with ``task``: :data:`EXTRACT_FIELDS`, :data:`TARGET_LANG`, else None."""
    if task == "extract":
        return TaskParams(fields=EXTRACT_FIELDS)
    if task == "translate":
        return TaskParams(target_lang=TARGET_LANG)
    return None


@dataclass(frozen=True)
class TaskRun:
    """One task in one mode: micro-batches through ``InferHandler.handle``, or a window through
    ``InferHandler.handle_record``.

    Attributes:
        task: The task.
        batch: Records per micro-batch, or in the window.
        ok: Pages answered ``ok``.
        unparsable: Pages answered ``unparsable_output`` (the engine answered, the parser refused).
        errors: Pages ending with any other error.
        seconds: Wall time of the timed part (warm-up batch excluded), s.
        output_tokens: Tokens the engine generated in that time (None: the engine does not count them).
    """

    task: str
    batch: int
    ok: int
    unparsable: int
    errors: int
    seconds: float
    output_tokens: int | None
    window: bool = False  # a window of ``batch`` records in flight, not micro-batches of ``batch``

    @property
    def key(self) -> str:
        """``b<N>`` for micro-batches of N, ``w<N>`` for a window of N."""
        return f"{'w' if self.window else 'b'}{self.batch}"

    @property
    def answered(self) -> int:
        """Pages the engine answered: ``ok`` + ``unparsable``."""
        return self.ok + self.unparsable

    @property
    def pages_per_s(self) -> float:
        """Answered pages per second of wall time."""
        return self.answered / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of wall time (None when not counted)."""
        if self.output_tokens is None:
            return None
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def format_report(runs: list[TaskRun]) -> str:
    """The per-task table: one row per task (in the order first run), per batch size its pages/s
    and output tokens/s, then the ratio of the largest batch's pages/s to batch 1's.

    Example (numbers are the caller's)::

        task        b1 pages/s  b1 tok/s  b8 pages/s  b8 tok/s  bmax/b1
        ocr               3.14     201.0       11.42     730.9     3.64
    """
    keys = sorted({r.key for r in runs}, key=lambda k: (k[0] == "w", int(k[1:])))
    tasks = list(dict.fromkeys(r.task for r in runs))
    by = {(r.task, r.key): r for r in runs}
    head = ["task".ljust(10)]
    for k in keys:
        head += [f"{k} pages/s".rjust(11), f"{k} tok/s".rjust(10)]
    head.append(f"{keys[-1]}/b1".rjust(8) if len(keys) > 1 and keys[0] == "b1" else "")
    lines = ["  ".join(head).rstrip()]
    for t in tasks:
        cells = [t.ljust(10)]
        for k in keys:
            r = by.get((t, k))
            tok = None if r is None else r.tokens_per_s
            cells += ["-".rjust(11) if r is None else f"{r.pages_per_s:11.2f}",
                      ("-" if tok is None else f"{tok:.1f}").rjust(10)]
        first, last = by.get((t, "b1")), by.get((t, keys[-1]))
        ratio = ""
        if len(keys) > 1 and first and last and first.pages_per_s > 0:
            ratio = f"{last.pages_per_s / first.pages_per_s:7.2f}x"
        cells.append(ratio)
        lines.append("  ".join(cells).rstrip())
    bad = [r for r in runs if r.unparsable or r.errors]
    for r in bad:
        lines.append(f"  {r.task} {r.key}: {r.unparsable} unparsable_output, {r.errors} other errors")
    return "\n".join(lines)


def result_json(runs: list[TaskRun]) -> dict[str, dict[str, dict[str, float | int | None]]]:
    """``{task: {"b<batch>" or "w<window>": {"pages_per_s", "output_tokens_per_s", "ok", "unparsable", "errors"}}}``
    (rates rounded to 3 decimals), for the ``RESULT`` line."""
    out: dict[str, dict[str, dict[str, float | int | None]]] = {}
    for r in runs:
        tok = r.tokens_per_s
        out.setdefault(r.task, {})[r.key] = {
            "pages_per_s": round(r.pages_per_s, 3), "output_tokens_per_s": None if tok is None else round(tok, 3),
            "ok": r.ok, "unparsable": r.unparsable, "errors": r.errors}
    return out
