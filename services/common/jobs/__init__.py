"""Jobs: many requests counted as one (``docs/jobs.md``).

- :mod:`.store`: jobs and their requests in MariaDB (what the jobs stage writes, the doors read).
- :mod:`.report`: a job's report, one row per request, streamed from MariaDB (CSV, JSONL, xlsx).
"""
