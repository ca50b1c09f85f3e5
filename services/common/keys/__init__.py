"""API keys of the HTTP door (:mod:`.api_keys`): created and revoked by the CLI, checked by the door."""
