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
    """One task at one ``max_batch``, measured through ``InferHandler.handle``.

    Attributes:
        task: The task.
        batch: ``max_batch``.
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
    batches = sorted({r.batch for r in runs})
    tasks = list(dict.fromkeys(r.task for r in runs))
    by = {(r.task, r.batch): r for r in runs}
    head = ["task".ljust(10)]
    for b in batches:
        head += [f"b{b} pages/s".rjust(11), f"b{b} tok/s".rjust(10)]
    head.append(f"b{batches[-1]}/b1".rjust(8) if len(batches) > 1 and batches[0] == 1 else "")
    lines = ["  ".join(head).rstrip()]
    for t in tasks:
        cells = [t.ljust(10)]
        for b in batches:
            r = by.get((t, b))
            tok = None if r is None else r.tokens_per_s
            cells += ["-".rjust(11) if r is None else f"{r.pages_per_s:11.2f}",
                      ("-" if tok is None else f"{tok:.1f}").rjust(10)]
        first, last = by.get((t, 1)), by.get((t, batches[-1]))
        ratio = ""
        if len(batches) > 1 and first and last and first.pages_per_s > 0:
            ratio = f"{last.pages_per_s / first.pages_per_s:7.2f}x"
        cells.append(ratio)
        lines.append("  ".join(cells).rstrip())
    bad = [r for r in runs if r.unparsable or r.errors]
    for r in bad:
        lines.append(f"  {r.task} b{r.batch}: {r.unparsable} unparsable_output, {r.errors} other errors")
    return "\n".join(lines)


def result_json(runs: list[TaskRun]) -> dict[str, dict[str, dict[str, float | int | None]]]:
    """``{task: {"b<batch>": {"pages_per_s", "output_tokens_per_s", "ok", "unparsable", "errors"}}}``
    (rates rounded to 3 decimals), for the ``RESULT`` line."""
    out: dict[str, dict[str, dict[str, float | int | None]]] = {}
    for r in runs:
        tok = r.tokens_per_s
        out.setdefault(r.task, {})[f"b{r.batch}"] = {
            "pages_per_s": round(r.pages_per_s, 3), "output_tokens_per_s": None if tok is None else round(tok, 3),
            "ok": r.ok, "unparsable": r.unparsable, "errors": r.errors}
    return out
