"""A stage process for the death tests (``python -m tests.dying_stage TOPIC GROUP OUT DLQ DIR``).

It runs the real stage lifecycle (:func:`services.common.app.run_stage`: runner, commit
metadata, SIGTERM drain) over ``TOPIC`` as group ``GROUP``, with batches of up to 4 records.
Each record's value is copied to ``OUT``, except:

* ``kill:<x>``: the process SIGKILLs itself while it holds the record (every time);
* ``kill-once:<x>``: the same, the first time only (a file in ``DIR`` remembers it);
* ``slow:<s>``: handling it takes ``s`` seconds.

Poison records go to ``DLQ`` as real ``ocr.dlq.v1`` events (:func:`services.common.dlq.poison_messages`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from pathlib import Path

from services.common.app import StageContext, run_stage
from services.common.dlq import poison_messages
from services.common.kafka import Outgoing
from services.common.runner import Handler
from services.common.settings import CommonSettings
from schemas.topics import Topics


class DyingHandler(Handler):
    def __init__(self, out: str, topics: Topics, marks: Path):
        self.out, self.topics, self.marks = out, topics, marks

    async def handle(self, records):
        for r in records:
            value = r.value or b""
            if value.startswith(b"slow:"):
                await asyncio.sleep(float(value[5:]))
            once = value.startswith(b"kill-once:")
            if value.startswith(b"kill:") or once:
                mark = self.marks / hashlib.sha256(value).hexdigest()
                if not (once and mark.exists()):
                    mark.touch()
                    print(f"dying on offset {r.offset}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        return [Outgoing(self.out, None, r.value or b"") for r in records]

    def poison(self, record, exc, attempts):
        return poison_messages(stage="dying", topics=self.topics, record=record, exc=exc, attempts=attempts)


async def main(topic: str, group: str, out: str, dlq: str, marks: str) -> None:
    settings = CommonSettings()
    topics = settings.topics.model_copy(update={"dlq": dlq, "results": out})

    async def build(ctx: StageContext) -> Handler:
        return DyingHandler(out, topics, Path(marks))

    await run_stage(stage="dying", settings=settings, topic=topic, group_id=group, build_handler=build,
                    max_batch=4, max_wait_ms=200)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
