"""Moved to :mod:`services.api` (the HTTP door is its own package). Only ``keys`` is left here, for
``services/cli/main.py`` until it imports ``services.api.keys``; delete this package then."""
