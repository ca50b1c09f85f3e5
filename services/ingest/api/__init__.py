"""The HTTP front door of the ingest stage: ``python -m services.ingest.api``."""
