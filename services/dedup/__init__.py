"""Dedup stage: answers repeats from the cache and lets exactly one copy of a new image through."""
