"""Code shared by every stage: settings, clients, the consume-handle-produce-commit runner, telemetry."""
