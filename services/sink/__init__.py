"""Sink stage: result documents to S3, final states to MariaDB, cache entries to Redis, completions to Kafka."""
