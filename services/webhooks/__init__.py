"""Webhooks stage: completions that name a callback, delivered signed to it, retried until they land or give up."""
