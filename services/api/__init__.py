"""The HTTP front door (FastAPI): ``python -m services.api``. A service of its own, beside the stages."""
