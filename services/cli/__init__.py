"""The ``ocrstream`` command line (typer)."""
