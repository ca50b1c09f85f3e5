"""Code shared by the stages, in two layers (``docs/architecture.md``, "Where code lives").

The core, this package's own modules: the settings every stage has, the Kafka/S3/MariaDB clients,
the consume-handle-produce-commit runner and the handler contract, records, producing, retry,
deaths, the DLQ, telemetry and errors. Every stage uses it; it imports no concept and no stage.

One subpackage per concept, owning that concept's code wherever a stage uses it: :mod:`.cache`,
:mod:`.documents`, :mod:`.images`, :mod:`.jobs`, :mod:`.keys`, :mod:`.requests`, :mod:`.results`,
:mod:`.webhooks`.
A concept imports the core and other concepts, never a stage (an import-linter contract).
"""
