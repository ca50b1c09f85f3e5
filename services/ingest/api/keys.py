"""Moved to :mod:`services.api.keys`; kept only until ``services/cli/main.py`` imports it from there."""

from services.api.keys import KeyStore

__all__ = ["KeyStore"]
