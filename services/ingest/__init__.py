"""Ingest stage: validates submissions, stores each image once in S3 by SHA-256, emits ocr.requests."""
