"""``python -m services.ingest.api``: serve the HTTP front door until SIGTERM."""

from services.ingest.api.app import serve

if __name__ == "__main__":
    serve()
