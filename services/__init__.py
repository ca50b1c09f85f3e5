"""ocrstream services: the four pipeline stages, their shared code and the CLI."""
