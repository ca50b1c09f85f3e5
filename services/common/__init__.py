"""Code shared by the stages, in two layers (``docs/architecture.md``, "Where code lives").

The core, this package's own modules: settings, the Kafka/S3/MariaDB/Redis clients, the
consume-handle-produce-commit runner and its window, records, producing, retry, deaths, the DLQ,
telemetry and errors. Every stage uses it; it imports no concept and no stage.

One subpackage per concept, owning that concept's code wherever a stage uses it: :mod:`.cache`,
:mod:`.documents`, :mod:`.images`, :mod:`.jobs`, :mod:`.keys`, :mod:`.requests`, :mod:`.results`,
:mod:`.webhooks`.
A concept imports the core and other concepts, never a stage (an import-linter contract).
"""
