"""Infer stage: micro-batches of cache misses through the OCR engine."""
